"""Every failure while serving a request, as an HTTP status and OpenAI's error body.

Client mistakes arrive as `RequestError` (cluster/protocol.py) and keep their status;
anything else is mapped here: overload (Serve's back-pressure, the engine's waiting-queue
cap) -> 429/503 with Retry-After, a dead engine -> 503, a `ValueError` -> 400, the rest
-> 500, logged with its traceback.
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from cluster.protocol import RequestError

logger = logging.getLogger(__name__)

# Retry-After (seconds) sent with 429/503 when the overload signal carries none.
DEFAULT_RETRY_AFTER_S = 1


def error_message(e: BaseException) -> str:
    """The text of `e`, or of the replica's exception a RayTaskError wraps."""
    cause = getattr(e, "cause", None)
    return str(cause if isinstance(cause, BaseException) else e).strip() or type(e).__name__


def map_exception(e: BaseException) -> RequestError:
    """The HTTP status and OpenAI error for any failure while serving a request."""
    if isinstance(e, RequestError):
        return e
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and cause is not e:
        return map_exception(cause)
    status = getattr(e, "status_code", None)
    if status in (429, 503):  # Serve's BackPressureError, or an engine queue cap
        return RequestError(
            f"the server is overloaded: {error_message(e).rstrip('.')}; retry later",
            status=status, err_type="server_overloaded",
            code="rate_limit_exceeded" if status == 429 else "service_unavailable",
            retry_after=getattr(e, "retry_after_s", None) or DEFAULT_RETRY_AFTER_S)
    if isinstance(e, ValueError):
        return RequestError(error_message(e))
    engine_err = _engine_error(e)
    if engine_err is not None:
        return engine_err
    logger.exception("request failed", exc_info=e)
    return RequestError(f"internal server error: {type(e).__name__}: {error_message(e)}",
                        status=500, err_type="server_error")


def _engine_error(e: BaseException) -> RequestError | None:
    # Imported here: the protocol layer must not pull in the engine (and torch) to load.
    from cluster.engine import EngineDeadError, OverloadedError

    if isinstance(e, OverloadedError):
        return RequestError(f"the server is overloaded: {e}; retry later", status=429,
                            err_type="server_overloaded", code="rate_limit_exceeded",
                            retry_after=DEFAULT_RETRY_AFTER_S)
    if isinstance(e, EngineDeadError):
        return RequestError(f"the engine is dead: {e}; the replica is being replaced, retry "
                            "shortly", status=503, err_type="server_error", code="engine_dead",
                            retry_after=DEFAULT_RETRY_AFTER_S)
    return None


def error_response(err: RequestError) -> JSONResponse:
    """`err` as a JSON response with its status (and Retry-After, in whole seconds >= 1)."""
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    return JSONResponse(err.body(), status_code=err.status, headers=headers)
