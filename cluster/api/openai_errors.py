"""Every failure while serving a request, as an HTTP status and OpenAI's error body.

What a client reads is a message it can act on and the request id, never a traceback, a
host, a path or an IP. Client mistakes arrive as `RequestError` (cluster/api/protocol.py) or as
the `ValueError`s of request validation (the engine, SamplingParams) and keep their text:
the client needs it to fix the request. Overload (Serve's back-pressure, the engine's
waiting-queue cap) -> 429/503 with Retry-After and the reason. A dead engine -> 503 and
anything else -> 500, both with a fixed message that names the request id; what went wrong
(a worker's traceback, a node's address) goes to the server log under that id.
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from cluster.api.protocol import RequestError
from cluster.engine.errors import EngineDeadError, OverloadedError

# The replicas' Serve log (logs/serve/replica_*.log), where an operator looks up a request id.
logger = logging.getLogger("ray.serve")

# Retry-After (seconds) sent with 429/503 when the overload signal carries none.
DEFAULT_RETRY_AFTER_S = 1
# A client-facing message taken from an exception is cut to its first line and this length:
# enough for any validation message, too short to carry a traceback.
_MAX_MESSAGE_CHARS = 500
# nginx's status for "client closed the request": logged, never read by the client.
CLIENT_CLOSED_STATUS = 499


def error_message(e: BaseException) -> str:
    """The text of `e`, or of the replica's exception a RayTaskError wraps."""
    cause = getattr(e, "cause", None)
    return str(cause if isinstance(cause, BaseException) else e).strip() or type(e).__name__


def _client_text(e: BaseException) -> str:
    return error_message(e).splitlines()[0][:_MAX_MESSAGE_CHARS]


def map_exception(e: BaseException, request_id: str) -> RequestError:
    """The HTTP status and OpenAI error for any failure while serving request `request_id`."""
    if isinstance(e, RequestError):
        return e
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and cause is not e:
        return map_exception(cause, request_id)
    if isinstance(e, ClientDisconnect):  # the client went away while sending its body
        return RequestError("the client closed the connection", status=CLIENT_CLOSED_STATUS)
    status = getattr(e, "status_code", None)
    if status in (429, 503):  # Serve's BackPressureError, or an engine queue cap
        return RequestError(
            f"the server is overloaded: {_client_text(e).rstrip('.')}; retry later",
            status=status, err_type="server_overloaded",
            code="rate_limit_exceeded" if status == 429 else "service_unavailable",
            retry_after=getattr(e, "retry_after_s", None) or DEFAULT_RETRY_AFTER_S)
    if isinstance(e, ValueError):
        return RequestError(_client_text(e))
    engine_err = _engine_error(e, request_id)
    if engine_err is not None:
        return engine_err
    logger.error("request %s failed", request_id, exc_info=e)
    return RequestError(f"internal server error (request id {request_id})", status=500,
                        err_type="server_error")


def _engine_error(e: BaseException, request_id: str) -> RequestError | None:
    if isinstance(e, OverloadedError):
        return RequestError(f"the server is overloaded: {_client_text(e)}; retry later",
                            status=429, err_type="server_overloaded", code="rate_limit_exceeded",
                            retry_after=DEFAULT_RETRY_AFTER_S)
    if isinstance(e, EngineDeadError):
        logger.error("request %s: the engine is dead: %s", request_id, e)
        return RequestError(f"the engine is not available; the replica is being replaced, retry "
                            f"shortly (request id {request_id})", status=503,
                            err_type="server_error", code="engine_dead",
                            retry_after=DEFAULT_RETRY_AFTER_S)
    return None


def error_response(err: RequestError) -> JSONResponse:
    """`err` as a JSON response with its status (and Retry-After, in whole seconds >= 1)."""
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    return JSONResponse(err.body(), status_code=err.status, headers=headers)
