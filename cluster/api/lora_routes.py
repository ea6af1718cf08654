"""vLLM's runtime adapter routes: `POST /v1/load_lora_adapter` `{lora_name, lora_path}` and
`POST /v1/unload_lora_adapter` `{lora_name}`, over an ingress's `LoRAModels`
(cluster/api/lora_models.py).

Off unless the manifest sets `allow_runtime_lora_updating` (then both answer 404 saying so);
under /v1, so behind the API key when one is set. A load is done when every running replica
has read and checked the adapter: a bad one is a 400 naming the field (cluster/engine/lora.py)
and is not served. As in vLLM: loading a name already served is a 400, unloading an unknown
one a 404, and success is a 200 with a line of plain text.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from cluster.api.openai_errors import error_response, map_exception
from cluster.api.protocol import RequestError, validation_error_message

MAX_BODY_BYTES = 1 << 16  # a name and a path


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    model: str | None = None  # the base model (an app of several models; None: the first)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # (vLLM's body has it; the name decides here)
    model: str | None = None


def add_lora_routes(app: FastAPI, serving: Any) -> None:
    """Register the two routes on `app`, over `serving` (OpenAIServing: its `loras`, `client`,
    `read_body` and base model name)."""

    async def load(request: Request) -> Response:
        try:
            req = await _read(serving, request, LoadLoRAAdapterRequest)
            if not req.lora_name or not req.lora_path:
                raise RequestError("both lora_name and lora_path must be non-empty",
                                   param="lora_name" if not req.lora_name else "lora_path")
            if req.lora_name == serving.served_model_name or req.lora_name in serving.loras.adapters:
                raise RequestError(f"The lora adapter '{req.lora_name}' has already been "
                                   "loaded.", param="lora_name")
            await serving.loras.add(req.lora_name, req.lora_path, serving.client.add_lora)
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return error_response(map_exception(e, request.state.request_id))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload(request: Request) -> Response:
        try:
            req = await _read(serving, request, UnloadLoRAAdapterRequest)
            if serving.loras.adapters.pop(req.lora_name, None) is None:
                raise RequestError(f"The lora adapter '{req.lora_name}' cannot be found.",
                                   status=404, param="lora_name", code="model_not_found")
            await serving.client.remove_lora(req.lora_name)
        except Exception as e:  # noqa: BLE001
            return error_response(map_exception(e, request.state.request_id))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed "
                                 "successfully.")

    app.add_api_route("/v1/load_lora_adapter", load, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", unload, methods=["POST"])


async def _read(serving: Any, request: Request, kind: type[BaseModel]) -> Any:
    if not serving.loras.allow_runtime_updating:
        raise RequestError(f"{request.url.path} is off; set allow_runtime_lora_updating: true "
                           "(with enable_lora: true) in the manifest to load and unload "
                           "adapters at runtime", status=404, code="not_found")
    await serving.info()  # (the base model's served name)
    body = await serving.read_body(request, MAX_BODY_BYTES)
    try:
        req = kind.model_validate_json(body or b"")
    except ValidationError as e:
        msg, param = validation_error_message(e.errors(include_url=False))
        raise RequestError(msg, param=param) from None
    if req.model not in (None, serving.served_model_name):
        raise RequestError(f"model `{req.model}` is not a base model this server serves "
                           f"(`{serving.served_model_name}`)", status=404, param="model",
                           code="model_not_found")
    return req
