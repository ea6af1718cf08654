"""`FrontDoor`: the pure-ASGI layer in front of every route of a model's app (and of the
several-models dispatch, cluster/api/multi_model.py): each request's id, and the API key.
"""

from __future__ import annotations

import hmac
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.api.openai_errors import error_response
from cluster.api.protocol import RequestError


class FrontDoor:
    """Pure ASGI, in front of every route: gives each request its id and, when an API key is
    set, checks it on the model's routes (/v1 and the tokenizer's).

    The id is the request's X-Request-Id when it has one (Serve's own middleware sets it on
    every request it proxies, and sends it back) and otherwise a new one, sent back as
    X-Request-Id; handlers read it as `request.state.request_id`. The bearer scheme is matched
    case-insensitively (RFC 7235), the key in constant time.
    """

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        request_id = given.decode("latin-1") if given else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        if given is None:
            id_header = (b"x-request-id", request_id.encode())
            # (so a FrontDoor behind this one, cluster/api/multi_model.py, takes the same id)
            scope["headers"] = [*scope["headers"], id_header]

            async def send_with_id(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", ()), id_header]
                await send(message)
        else:
            send_with_id = send

        if self.api_key and _needs_key(scope["path"]) and not self._authorized(scope):
            denied = error_response(RequestError(
                "missing or invalid API key; send 'Authorization: Bearer <key>'",
                status=401, err_type="invalid_request_error", code="invalid_api_key"))
            await denied(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)

    def _authorized(self, scope: Scope) -> bool:
        assert self.api_key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                return (scheme.lower() == b"bearer"
                        and hmac.compare_digest(token.strip(), self.api_key))
        return False


def _needs_key(path: str) -> bool:
    return path.startswith("/v1") or path in ("/tokenize", "/detokenize")
