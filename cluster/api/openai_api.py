"""The OpenAI-compatible HTTP API: a FastAPI app over any `EngineClient`.

The app does what is per-request and cheap: parse and validate the body, render chat
messages through the model's own chat template, tokenize, check the context length
(cluster/api/openai_prompts.py), and turn the engine's `RequestOutput` deltas into OpenAI's
response and SSE chunk shapes (cluster/api/openai_responses.py). It never blocks on the engine's
work: the engine runs behind an `EngineClient` (a Serve DeploymentHandle in production, the
engine object itself in tests and offline use).

Invariants:
- every response with status >= 400 carries OpenAI's error body (cluster/api/openai_errors.py),
  and every response its request id as X-Request-Id;
- a request body is read only up to `max_body_bytes`: 413 as soon as it is over (HAProxy and
  Serve's proxy still deliver it to a client that is sending the rest), and a prompt bigger
  than INLINE_PROMPT_BYTES is rendered and tokenized in a worker thread: one heavy request
  never holds the event loop that every other request's tokens pass through;
- a request whose generator is closed early (client gone) closes the engine-side stream,
  which aborts the request in the engine;
- nothing in a request body reaches the engine unvalidated: token ids are checked against
  the vocabulary and lengths against max_model_len here, so a client cannot crash a worker.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.api.async_streams import first_delta, merge_streams, tag_stream
from cluster.api.engine_client import EngineClient, ModelInfo
from cluster.api.front_door import FrontDoor
from cluster.api.lora_models import LoRAModels, request_lora
from cluster.api.lora_routes import add_lora_routes
from cluster.api.openai_errors import error_message, error_response, map_exception
from cluster.api.openai_prompts import PromptProcessor
from cluster.api.openai_responses import ChatBuilder, CompletionBuilder, respond
from cluster.api.pooling_api import add_pooling_routes
from cluster.api.prometheus import render_prometheus
from cluster.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    TokenizeChatRequest,
    TokenizeRequest,
    validation_error_message,
)
from cluster.api.responses_api import create_response
from scheduler.lora import LoRARequest
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")

# The default request-body limit: room for a whole context of text at a generous 32 bytes
# per token (JSON-escaped CJK text takes ~9), and never below 1 MiB.
BODY_BYTES_PER_TOKEN = 32
MIN_BODY_BYTES = 1 << 20
# Prompts (request bodies) up to this size are rendered and tokenized on the event loop, in
# about a millisecond; bigger ones in a worker thread, where they cannot stall other requests
# and small requests never queue behind them.
INLINE_PROMPT_BYTES = 8 << 10


def default_max_body_bytes(max_model_len: int) -> int:
    """The request-body limit when the manifest sets none: see BODY_BYTES_PER_TOKEN."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def create_app(client: EngineClient, tokenizer: Any, *, served_model_name: str | None = None,
               api_key: str | None = None, max_body_bytes: int | None = None,
               reasoning_parser: str | None = None, tool_call_parser: str | None = None,
               loras: LoRAModels | None = None) -> FastAPI:
    """The FastAPI app serving /v1/models, /v1/completions, /v1/chat/completions, /v1/responses,
    /v1/embeddings, /v1/score, /v1/rerank (cluster/api/pooling_api.py), /tokenize, /detokenize,
    /health, /metrics, /v1/load_lora_adapter, /v1/unload_lora_adapter.

    `api_key`, when set, is required as `Authorization: Bearer <key>` on every /v1 route and on
    /tokenize and /detokenize (as in vLLM, /health and /metrics stay open for probes and
    scrapers).
    `max_body_bytes`: the largest request body accepted (413 beyond it); None: sized from
    max_model_len by `default_max_body_bytes`.
    `reasoning_parser` / `tool_call_parser`: EngineConfig's settings of those names.
    `loras`: the LoRA adapters served by name (cluster/api/lora_models.py); None: none.
    """
    serving = OpenAIServing(client, tokenizer, served_model_name, max_body_bytes,
                            reasoning_parser, tool_call_parser, loras)
    app = FastAPI(title="qwen3-serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_api_route("/v1/models", serving.list_models, methods=["GET"])
    app.add_api_route("/v1/completions", serving.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", serving.chat_completions, methods=["POST"])
    app.add_api_route("/v1/responses", serving.responses, methods=["POST"])
    app.add_api_route("/tokenize", serving.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", serving.detokenize, methods=["POST"])
    app.add_api_route("/health", serving.health, methods=["GET"])
    app.add_api_route("/metrics", serving.metrics, methods=["GET"])
    add_pooling_routes(app, serving)
    add_lora_routes(app, serving)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_middleware(FrontDoor, api_key=api_key)
    app.state.serving = serving  # (cluster/api/multi_model.py reads its served names)
    return app


def _request_id(request: Request) -> str:
    """The id FrontDoor gave this request (a fresh one for a request built without it)."""
    return getattr(request.state, "request_id", None) or uuid.uuid4().hex


def _engine_request_id(prefix: str) -> str:
    """A new id for the engine and the response body: unique, whatever X-Request-Id a client
    sends. Errors name it, and the server log records it next to Serve's request id."""
    return f"{prefix}-{uuid.uuid4().hex}"


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"Invalid URL ({where}); this server serves /v1/models, /v1/completions, " \
                  "/v1/chat/completions, /v1/responses, /v1/embeddings, /v1/score, /v1/rerank, " \
                  "/tokenize, /detokenize, /health and /metrics"
    elif exc.status_code == 405:
        message = f"Method not allowed ({where}); allowed: {(exc.headers or {}).get('Allow')}"
    else:
        message = f"{exc.detail} ({where})"
    response = error_response(RequestError(message, status=exc.status_code))
    response.headers.update(exc.headers or {})
    return response


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    msg, param = validation_error_message(list(exc.errors()))
    return error_response(RequestError(msg, param=param))


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    return error_response(map_exception(exc, _request_id(request)))


class OpenAIServing:
    """Request handlers; one instance per ingress replica."""

    def __init__(self, client: EngineClient, tokenizer: Any,
                 served_model_name: str | None = None, max_body_bytes: int | None = None,
                 reasoning_parser: str | None = None, tool_call_parser: str | None = None,
                 loras: LoRAModels | None = None) -> None:
        self.client = client
        self.loras = loras or LoRAModels()
        self.served_model_name = served_model_name
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        self.prompts = PromptProcessor(tokenizer)
        # Where the served model (its tokenizer) lives, as vLLM reports it in /v1/models' `root`:
        # load tools (guidellm) read the tokenizer from there.
        self.model_root = str(getattr(tokenizer, "name_or_path", "") or "") or None
        self.max_body_bytes = max_body_bytes
        self._info: ModelInfo | None = None
        # Rendering and tokenizing big prompts; the Rust tokenizer releases the GIL.
        self._prompt_pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                               thread_name_prefix="prompts")

    async def info(self) -> ModelInfo:
        if self._info is None:
            self._info = await self.client.model_info()
            if self.served_model_name is None:
                self.served_model_name = self._info.model_name
        return self._info

    def body_limit(self, info: ModelInfo) -> int:
        return self.max_body_bytes or default_max_body_bytes(info.max_model_len)

    async def list_models(self) -> Response:
        info = await self.info()
        return JSONResponse({"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": 0,
            "owned_by": "qwen3-serve", "root": self.model_root or info.model_name, "parent": None,
            "max_model_len": info.max_model_len},
            *self.loras.cards(self.served_model_name, info.max_model_len)]})

    async def health(self, request: Request) -> Response:
        try:
            await self.client.check_health()
        except Exception as e:  # noqa: BLE001 - any failure means "not healthy"
            rid = _request_id(request)
            logger.warning("health check %s: the engine is not healthy: %s", rid, error_message(e))
            return error_response(RequestError(f"the engine is not healthy (request id {rid})",
                                               status=503, err_type="server_error"))
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        try:
            snapshots = await self.client.metrics()
            info = await self.info()
        except Exception as e:  # noqa: BLE001
            return error_response(map_exception(e, _request_id(request)))
        return PlainTextResponse(render_prometheus(snapshots, info.model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        rid = _engine_request_id("cmpl")
        try:
            info, body, req = await self._read(request, lambda _: CompletionRequest)
            self._check_n(req.n, info)
            prompts = await self._off_loop(len(body), self.prompts.completion_prompts,
                                           req.prompt, info.max_model_len)
            params = [req.to_sampling_params(
                self.prompts.max_tokens(req.generated_max_tokens, len(p), info.max_model_len),
                info.sampling_defaults) for p in prompts]
            stream = self._start(prompts, params, rid, req.cache_salt, _routing_key(request, req),
                                 request_lora(request))
            first = await first_delta(stream)
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return error_response(map_exception(e, rid))
        echo = [self.prompts.echo_text(p, req) for p in prompts]
        builder = CompletionBuilder(self.model_name(request), self.prompts.token_text, rid, req,
                                    prompts, echo)
        return _name_replica(await respond(builder, first, stream, req.stream), first)

    async def chat_completions(self, request: Request) -> Response:
        rid = _engine_request_id("chatcmpl")
        try:
            info, body, req = await self._read(request, lambda _: ChatCompletionRequest)
            self._check_n(req.n, info)
            if req.uses_tools and self.tool_call_parser is None:
                raise RequestError("tools need the server's tool_call_parser setting (hermes "
                                   "for Qwen3), which is off; ask for it or send no tools",
                                   param="tools")
            prompt = await self._off_loop(len(body), self.prompts.render_chat, req,
                                          info.max_model_len)
            max_tokens = self.prompts.max_tokens(req.requested_max_tokens, len(prompt),
                                                 info.max_model_len)
            params = req.to_sampling_params(
                max_tokens, info.sampling_defaults,
                reasoning=self.reasoning_parser is not None and req.thinking)
            stream = self._start([prompt], [params], rid, req.cache_salt,
                                 _routing_key(request, req), request_lora(request))
            first = await first_delta(stream)
        except Exception as e:  # noqa: BLE001
            return error_response(map_exception(e, rid))
        builder = ChatBuilder(self.model_name(request), self.prompts.token_text, rid, req, prompt,
                              self.reasoning_parser, self.tool_call_parser)
        return _name_replica(await respond(builder, first, stream, req.stream), first)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, on the chat route's steps (cluster/api/responses_api.py)."""
        return await create_response(self, request)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt's or a conversation's token ids, counted as the generation
        routes count them (not refused when longer than the context: it is a way to find out)."""
        rid = _engine_request_id("tokenize")
        try:
            info, body, req = await self._read(request, lambda body: (
                TokenizeChatRequest if _has_key(body, "messages") else TokenizeRequest))
            if isinstance(req, TokenizeChatRequest):
                ids = await self._off_loop(len(body), self.prompts.render_chat, req, sys.maxsize)
            else:
                encode = functools.partial(self.prompts.tokenizer.encode,
                                           add_special_tokens=req.add_special_tokens)
                ids = await self._off_loop(len(body), encode, req.prompt)
        except Exception as e:  # noqa: BLE001
            return error_response(map_exception(e, rid))
        return JSONResponse({
            "count": len(ids), "max_model_len": info.max_model_len, "tokens": ids,
            "token_strs": (self.prompts.tokenizer.convert_ids_to_tokens(ids)
                           if req.return_token_strs else None)})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids (inside the vocabulary) to text."""
        rid = _engine_request_id("detokenize")
        try:
            info, body, req = await self._read(request, lambda _: DetokenizeRequest)
            if req.tokens:
                self.prompts.check_ids(req.tokens, "tokens")
            text = await self._off_loop(len(body), self.prompts.tokenizer.decode, req.tokens)
        except Exception as e:  # noqa: BLE001
            return error_response(map_exception(e, rid))
        return JSONResponse({"prompt": text})

    async def _read(self, request: Request, kind: Callable[[bytes], type]
                    ) -> tuple[ModelInfo, bytes, Any]:
        """The model's info, the request's body (within the size limit) and the body parsed as
        `kind(body)`, for the model this server serves."""
        info = await self.info()
        body = await self.read_body(request, self.body_limit(info))
        req = _parse(kind(body), body)
        request.state.lora_request = await self.loras.resolve(
            req.model, self.served_model_name, self.client.add_lora)
        return info, body, req

    @staticmethod
    async def read_body(request: Request, limit: int) -> bytes:
        """The JSON request body, at most `limit` bytes of it (413 beyond, 415 if not JSON)."""
        content_type = request.headers.get("content-type")
        if content_type is not None:
            media = content_type.split(";", 1)[0].strip().lower()
            if media != "application/json" and not media.endswith("+json"):
                raise RequestError(f"Content-Type {media!r} is not supported; send the body as "
                                   "JSON with 'Content-Type: application/json'", status=415)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _body_too_large(int(declared), limit)
        chunks, received = [], 0
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise _body_too_large(received, limit, at_least=True)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _off_loop(self, body_bytes: int, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, in the prompt thread pool when the body is big (INLINE_PROMPT_BYTES)."""
        if body_bytes <= INLINE_PROMPT_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._prompt_pool, fn, *args)

    @staticmethod
    def _check_n(n: int, info: ModelInfo) -> None:
        if info.max_num_seqs is not None and n > info.max_num_seqs:
            raise RequestError(f"n={n} is more samples than this server runs at once "
                               f"(max_num_seqs={info.max_num_seqs}); ask for at most "
                               f"{info.max_num_seqs}", param="n")

    def model_name(self, request: Request) -> str:
        """The `model` a response names: the request's adapter, else the served model."""
        lora = request_lora(request)
        return lora.lora_name if lora is not None else self.served_model_name

    def _start(self, prompts: list[list[int]], params: list[SamplingParams], rid: str,
               cache_salt: str | None, routing_key: str | None = None,
               lora: LoRARequest | None = None,
               pooling: bool = False) -> AsyncIterator[tuple[int, Any]]:
        if not pooling and self._info is not None and self._info.pooling is not None:
            raise RequestError(f"`{self.served_model_name}` is a pooling model (runner: "
                               "pooling); it answers /v1/embeddings, /v1/score and /v1/rerank, "
                               "not generation", param="model")
        if len(prompts) == 1:
            return tag_stream(0, self.client.generate(prompts[0], params[0], rid, cache_salt,
                                                      routing_key, lora))
        return merge_streams([self.client.generate(p, sp, f"{rid}-{i}", cache_salt, routing_key,
                                                   lora)
                              for i, (p, sp) in enumerate(zip(prompts, params))])


def _routing_key(request: Request, body: Any) -> str | None:
    """What keeps a conversation on one replica: `prompt_cache_key`, else `X-Session-Id`."""
    return body.prompt_cache_key or request.headers.get("x-session-id") or None


def _name_replica(response: Response, first: tuple[int, Any] | None) -> Response:
    """`X-Replica-Id`: the LLMServer replica that served the (first) prompt, when known."""
    replica_id = getattr(first[1], "replica_id", None) if first is not None else None
    if replica_id:
        response.headers["X-Replica-Id"] = replica_id
    return response


def _body_too_large(size: int, limit: int, at_least: bool = False) -> RequestError:
    return RequestError(f"the request body is {'at least ' if at_least else ''}{size} bytes; this "
                        f"server accepts at most {limit} (max_request_body_bytes)", status=413,
                        code="request_too_large")


def _has_key(body: bytes, key: str) -> bool:
    """Whether the body is a JSON object with `key` (False for anything else: the parse that
    follows reports what is wrong with it)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    return isinstance(obj, dict) and key in obj


def _parse(model: type, body: bytes) -> Any:
    try:
        return model.model_validate_json(body or b"")
    except ValidationError as e:
        msg, param = validation_error_message(e.errors(include_url=False))
        raise RequestError(msg, param=param) from None


def create_model_app(client: EngineClient, spec: dict[str, Any], api_key: str | None) -> FastAPI:
    """`create_app` for one base model's manifest keys (`spec`: cluster/api/serve_app.py
    `ingress_spec`'s), its tokenizer loaded from the model's files."""
    from transformers import AutoTokenizer

    from workers.tiny_model import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(spec["model"]))
    if spec["tool_call_parser"] is not None:
        import xgrammar  # noqa: F401 — loaded now, not on the first forced tool call (~2 s)
    return create_app(client, tokenizer,
                      served_model_name=spec["served_model_name"], api_key=api_key,
                      max_body_bytes=spec["max_request_body_bytes"],
                      reasoning_parser=spec["reasoning_parser"],
                      tool_call_parser=spec["tool_call_parser"], loras=spec["loras"])
