"""The OpenAI-compatible HTTP API: a FastAPI app over any `EngineClient`.

The app does what is per-request and cheap: parse and validate the body, render chat
messages through the model's own chat template, tokenize, check the context length
(cluster/openai_prompts.py), and turn the engine's `RequestOutput` deltas into OpenAI's
response and SSE chunk shapes (cluster/openai_responses.py). It never blocks on the engine's
work: the engine runs behind an `EngineClient` (a Serve DeploymentHandle in production, the
engine object itself in tests and offline use).

Invariants:
- every response with status >= 400 carries OpenAI's error body (cluster/openai_errors.py);
- a request whose generator is closed early (client gone) closes the engine-side stream,
  which aborts the request in the engine;
- nothing in a request body reaches the engine unvalidated: token ids are checked against
  the vocabulary and lengths against max_model_len here, so a client cannot crash a worker.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from cluster.async_streams import first_delta, merge_streams, tag_stream
from cluster.openai_errors import error_message, error_response, map_exception
from cluster.openai_prompts import PromptProcessor
from cluster.openai_responses import ChatBuilder, CompletionBuilder, respond
from cluster.prometheus import render_prometheus
from cluster.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    validation_error_message,
)
from scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class ModelInfo:
    model_name: str
    max_model_len: int


class EngineClient(Protocol):
    """What the HTTP layer needs from an engine (local object or remote deployment)."""

    async def model_info(self) -> ModelInfo: ...

    def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 request_id: str, cache_salt: str | None = None) -> AsyncIterator[Any]: ...

    async def check_health(self) -> None: ...

    async def metrics(self) -> list[dict[str, Any]]: ...


class LocalEngineClient:
    """An `EngineClient` over an engine object in this process (AsyncLLMEngine's API)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def model_info(self) -> ModelInfo:
        return ModelInfo(self.engine.model_name, self.engine.max_model_len)

    def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 request_id: str, cache_salt: str | None = None) -> AsyncIterator[Any]:
        return self.engine.generate(prompt_token_ids, sampling_params, request_id,
                                    cache_salt=cache_salt)

    async def check_health(self) -> None:
        self.engine.check_health()

    async def metrics(self) -> list[dict[str, Any]]:
        return [self.engine.metrics()]


def create_app(client: EngineClient, tokenizer: Any, *, served_model_name: str | None = None,
               api_key: str | None = None, reasoning_parser: str | None = None,
               tool_call_parser: str | None = None) -> FastAPI:
    """The FastAPI app serving /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

    `api_key`, when set, is required as `Authorization: Bearer <key>` on every /v1 route
    (as vLLM does, /health and /metrics stay open for probes and scrapers).
    `reasoning_parser` / `tool_call_parser`: EngineConfig's settings of those names.
    """
    serving = OpenAIServing(client, tokenizer, served_model_name, reasoning_parser,
                            tool_call_parser)
    app = FastAPI(title="qwen3-serve", docs_url=None, redoc_url=None)

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def check_api_key(request: Request, call_next: Callable) -> Response:
            if request.url.path.startswith("/v1"):
                got = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(got, expected):
                    return error_response(RequestError(
                        "missing or invalid API key; send 'Authorization: Bearer <key>'",
                        status=401, err_type="invalid_request_error", code="invalid_api_key"))
            return await call_next(request)

    app.add_api_route("/v1/models", serving.list_models, methods=["GET"])
    app.add_api_route("/v1/completions", serving.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", serving.chat_completions, methods=["POST"])
    app.add_api_route("/health", serving.health, methods=["GET"])
    app.add_api_route("/metrics", serving.metrics, methods=["GET"])
    return app


class OpenAIServing:
    """Request handlers; one instance per ingress replica."""

    def __init__(self, client: EngineClient, tokenizer: Any,
                 served_model_name: str | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None) -> None:
        self.client = client
        self.served_model_name = served_model_name
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        self.prompts = PromptProcessor(tokenizer)
        self._info: ModelInfo | None = None

    async def info(self) -> ModelInfo:
        if self._info is None:
            self._info = await self.client.model_info()
            if self.served_model_name is None:
                self.served_model_name = self._info.model_name
        return self._info

    async def list_models(self) -> Response:
        info = await self.info()
        return JSONResponse({"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": 0,
            "owned_by": "qwen3-serve", "root": info.model_name, "parent": None,
            "max_model_len": info.max_model_len}]})

    async def health(self) -> Response:
        try:
            await self.client.check_health()
        except Exception as e:  # noqa: BLE001 - any failure means "not healthy"
            return error_response(RequestError(f"engine is not healthy: {error_message(e)}",
                                               status=503, err_type="server_error"))
        return Response(status_code=200)

    async def metrics(self) -> Response:
        try:
            snapshots = await self.client.metrics()
            info = await self.info()
        except Exception as e:  # noqa: BLE001
            return error_response(map_exception(e))
        return PlainTextResponse(render_prometheus(snapshots, info.model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        try:
            req = _parse(CompletionRequest, await request.body())
            info = await self.info()
            self._check_model(req.model)
            prompts = self.prompts.completion_prompts(req.prompt)
            params = [req.to_sampling_params(
                self.prompts.max_tokens(req.max_tokens, len(p), info.max_model_len))
                for p in prompts]
            rid = f"cmpl-{uuid.uuid4().hex}"
            stream = self._start(prompts, params, rid, req.cache_salt)
            first = await first_delta(stream)
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return error_response(map_exception(e))
        echo = [self.prompts.echo_text(p, req) for p in prompts]
        builder = CompletionBuilder(self.served_model_name, self.prompts.token_text, rid, req,
                                    prompts, echo)
        return await respond(builder, first, stream, req.stream)

    async def chat_completions(self, request: Request) -> Response:
        try:
            req = _parse(ChatCompletionRequest, await request.body())
            info = await self.info()
            self._check_model(req.model)
            if req.uses_tools and self.tool_call_parser is None:
                raise RequestError("tools need the server's tool_call_parser setting (hermes "
                                   "for Qwen3), which is off; ask for it or send no tools",
                                   param="tools")
            prompt = self.prompts.render_chat(req)
            max_tokens = self.prompts.max_tokens(req.requested_max_tokens, len(prompt),
                                                 info.max_model_len)
            params = req.to_sampling_params(
                max_tokens, reasoning=self.reasoning_parser is not None and req.thinking)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            stream = self._start([prompt], [params], rid, req.cache_salt)
            first = await first_delta(stream)
        except Exception as e:  # noqa: BLE001
            return error_response(map_exception(e))
        builder = ChatBuilder(self.served_model_name, self.prompts.token_text, rid, req, prompt,
                              self.reasoning_parser, self.tool_call_parser)
        return await respond(builder, first, stream, req.stream)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise RequestError(f"The model `{model}` does not exist; this server serves "
                               f"`{self.served_model_name}`", status=404, param="model",
                               code="model_not_found")

    def _start(self, prompts: list[list[int]], params: list[SamplingParams], rid: str,
               cache_salt: str | None) -> AsyncIterator[tuple[int, Any]]:
        if len(prompts) == 1:
            return tag_stream(0, self.client.generate(prompts[0], params[0], rid, cache_salt))
        return merge_streams([self.client.generate(p, sp, f"{rid}-{i}", cache_salt)
                              for i, (p, sp) in enumerate(zip(prompts, params))])


def _parse(model: type, body: bytes) -> Any:
    try:
        return model.model_validate_json(body or b"")
    except ValidationError as e:
        msg, param = validation_error_message(e.errors(include_url=False))
        raise RequestError(msg, param=param) from None
