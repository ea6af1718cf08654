"""The OpenAI-compatible HTTP API: a FastAPI app over any `EngineClient`.

The app does what is per-request and cheap: parse and validate the body, render chat
messages through the model's own chat template, tokenize, check the context length, and
turn the engine's `RequestOutput` deltas into OpenAI's response and SSE chunk shapes. It
never blocks on the engine's work: the engine runs behind an `EngineClient` (a Serve
DeploymentHandle in production, the engine object itself in tests and offline use).

Invariants:
- every response with status >= 400 carries OpenAI's error body;
- a request whose generator is closed early (client gone) closes the engine-side stream,
  which aborts the request in the engine;
- nothing in a request body reaches the engine unvalidated: token ids are checked against
  the vocabulary and lengths against max_model_len here, so a client cannot crash a worker.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

from cluster.prometheus import render_prometheus
from cluster.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    validation_error_message,
)
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# JSON has no -inf; vLLM reports impossible tokens with this value instead.
_MIN_LOGPROB = -9999.0
# Retry-After (seconds) sent with 429/503 when the overload signal carries none.
DEFAULT_RETRY_AFTER_S = 1
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "tokenize", "return_dict", "tokenizer",
                                       "add_generation_prompt", "continue_final_message"})


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
               api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

    `api_key`, when set, is required as `Authorization: Bearer <key>` on every /v1 route
    (as vLLM does, /health and /metrics stay open for probes and scrapers).
    """
    serving = OpenAIServing(client, tokenizer, served_model_name)
    app = FastAPI(title="qwen3-serve", docs_url=None, redoc_url=None)

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def check_api_key(request: Request, call_next: Callable) -> Response:
            if request.url.path.startswith("/v1"):
                got = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(got, expected):
                    return _error_response(RequestError(
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
                 served_model_name: str | None = None) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self._info: ModelInfo | None = None
        self._vocab_size = len(tokenizer)
        self._token_text: dict[int, str] = {}

    async def info(self) -> ModelInfo:
        if self._info is None:
            self._info = await self.client.model_info()
            if self.served_model_name is None:
                self.served_model_name = self._info.model_name
        return self._info

    # ---- routes -------------------------------------------------------------------------

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
            return _error_response(RequestError(f"engine is not healthy: {_message(e)}",
                                                status=503, err_type="server_error"))
        return Response(status_code=200)

    async def metrics(self) -> Response:
        try:
            snapshots = await self.client.metrics()
            info = await self.info()
        except Exception as e:  # noqa: BLE001
            return _error_response(_map_exception(e))
        return PlainTextResponse(render_prometheus(snapshots, info.model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        try:
            req = _parse(CompletionRequest, await request.body())
            info = await self.info()
            self._check_model(req.model)
            prompts = self._completion_prompts(req.prompt)
            params = [req.to_sampling_params(self._max_tokens(req.max_tokens, len(p), info))
                      for p in prompts]
            rid = f"cmpl-{uuid.uuid4().hex}"
            stream = self._start(prompts, params, rid, req.cache_salt)
            first = await _first(stream)
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return _error_response(_map_exception(e))
        echo = [self._echo_text(p, req) for p in prompts]
        return await _respond(_CompletionBuilder(self, rid, req, prompts, echo), first, stream,
                              req.stream)

    async def chat_completions(self, request: Request) -> Response:
        try:
            req = _parse(ChatCompletionRequest, await request.body())
            info = await self.info()
            self._check_model(req.model)
            prompt = self._render_chat(req)
            max_tokens = self._max_tokens(req.requested_max_tokens, len(prompt), info)
            params = req.to_sampling_params(max_tokens)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            stream = self._start([prompt], [params], rid, req.cache_salt)
            first = await _first(stream)
        except Exception as e:  # noqa: BLE001
            return _error_response(_map_exception(e))
        return await _respond(_ChatBuilder(self, rid, req, prompt), first, stream, req.stream)

    # ---- request preparation -------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise RequestError(f"The model `{model}` does not exist; this server serves "
                               f"`{self.served_model_name}`", status=404, param="model",
                               code="model_not_found")

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            batch: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            batch = [prompt]
        else:
            batch = list(prompt)
        if not batch:
            raise RequestError("prompt is empty; send a string or a list of token ids",
                               param="prompt")
        out = []
        for p in batch:
            ids = self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else p
            out.append(self._check_ids(ids, "prompt"))
        return out

    def _render_chat(self, req: ChatCompletionRequest) -> list[int]:
        kwargs = dict(req.chat_template_kwargs or {})
        bad = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if bad:
            raise RequestError(f"chat_template_kwargs may not set {bad}; use the request's own "
                               "fields for them", param="chat_template_kwargs")
        if req.continue_final_message and req.add_generation_prompt:
            raise RequestError("continue_final_message needs add_generation_prompt: false",
                               param="continue_final_message")
        messages = [m.to_template_dict() for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, **kwargs)
        except Exception as e:  # noqa: BLE001 - template errors are the client's messages
            raise RequestError(f"the chat template rejected the messages: {e}",
                               param="messages") from None
        return self._check_ids(self.tokenizer.encode(text, add_special_tokens=False), "messages")

    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise RequestError(f"{param} is empty after tokenization; send at least one token",
                               param=param)
        bad = next((t for t in ids if not 0 <= t < self._vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {self._vocab_size})",
                               param=param)
        return ids

    def _max_tokens(self, requested: int | None, prompt_len: int, info: ModelInfo) -> int:
        if requested is not None and requested < 1:
            raise RequestError(f"max_tokens must be an integer >= 1; got {requested}",
                               param="max_tokens")
        room = info.max_model_len - prompt_len
        if room < 1 or (requested is not None and requested > room):
            want = prompt_len + (requested or 1)
            raise RequestError(
                f"This model's maximum context length is {info.max_model_len} tokens. However, "
                f"you requested {want} tokens ({prompt_len} in the prompt, {requested or 1} in "
                "the completion). Please reduce the length of the prompt or completion.",
                param="max_tokens")
        return room if requested is None else requested

    def _echo_text(self, prompt: list[int], req: CompletionRequest) -> str:
        if not req.echo:
            return ""
        return self.tokenizer.decode(prompt, skip_special_tokens=req.skip_special_tokens)

    def _start(self, prompts: list[list[int]], params: list[SamplingParams], rid: str,
               cache_salt: str | None) -> AsyncIterator[tuple[int, Any]]:
        if len(prompts) == 1:
            return _tagged(0, self.client.generate(prompts[0], params[0], rid, cache_salt))
        return _merge([self.client.generate(p, sp, f"{rid}-{i}", cache_salt)
                       for i, (p, sp) in enumerate(zip(prompts, params))])

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


# ---- response building --------------------------------------------------------------------


class _Choice:
    """What one choice has produced so far."""

    __slots__ = ("text", "num_tokens", "finish_reason", "stop_reason", "lp_content",
                 "lp_tokens", "lp_token_logprobs", "lp_top", "lp_offsets", "offset")

    def __init__(self, prefix: str = "") -> None:
        self.text = prefix
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.lp_content: list[dict[str, Any]] = []
        self.lp_tokens: list[str] = []
        self.lp_token_logprobs: list[float] = []
        self.lp_top: list[dict[str, float]] = []
        self.lp_offsets: list[int] = []
        self.offset = len(prefix)


class _Builder(ABC):
    object_name = ""

    def __init__(self, serving: OpenAIServing, rid: str, n: int, num_prompts: int,
                 prompt_tokens: int, include_usage: bool) -> None:
        self.serving = serving
        self.rid = rid
        self.n = n
        self.created = int(time.time())
        self.model = serving.served_model_name
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = [0] * num_prompts
        self.include_usage = include_usage
        self.choices = [_Choice() for _ in range(n * num_prompts)]

    def usage(self) -> dict[str, Any]:
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}

    def chunk(self, choices: list[dict[str, Any]]) -> str:
        body: dict[str, Any] = {"id": self.rid, "object": self.object_name,
                                "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def usage_chunk(self) -> str:
        body = {"id": self.rid, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage()}
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def absorb(self, prompt_idx: int, out: Any) -> list[tuple[int, Any]]:
        """Record one delta; returns (choice index, CompletionOutput) for each output in it."""
        self.cached_tokens[prompt_idx] = out.num_cached_tokens or 0
        seen = []
        for c in out.outputs:
            idx = prompt_idx * self.n + c.index
            ch = self.choices[idx]
            ch.num_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                ch.finish_reason = c.finish_reason
                ch.stop_reason = c.stop_reason
            seen.append((idx, c))
        return seen

    @abstractmethod
    def top_logprobs_k(self) -> int:
        """How many alternatives per token the request asked for (0: none)."""

    def _ranked(self, lps: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(lps.items(), key=lambda kv: -kv[1])[:self.top_logprobs_k()]

    async def stream(self, first: tuple[int, Any] | None,
                     rest: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[str]:
        try:
            for chunk in self.preamble():
                yield chunk
            if first is not None:
                yield self.delta_chunk(*first)
                async for prompt_idx, out in rest:
                    yield self.delta_chunk(prompt_idx, out)
            if self.include_usage:
                yield self.usage_chunk()
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as vLLM does
            yield f"data: {json.dumps(_map_exception(e).body())}\n\n"
        finally:
            await _aclose(rest)
        yield "data: [DONE]\n\n"

    async def collect(self, first: tuple[int, Any] | None,
                      rest: AsyncIterator[tuple[int, Any]]) -> dict[str, Any]:
        try:
            if first is not None:
                self.delta_chunk(*first, render=False)
                async for prompt_idx, out in rest:
                    self.delta_chunk(prompt_idx, out, render=False)
        finally:
            await _aclose(rest)
        return self.final()

    def preamble(self) -> list[str]:
        return []


class _CompletionBuilder(_Builder):
    object_name = "text_completion"

    def __init__(self, serving: OpenAIServing, rid: str, req: CompletionRequest,
                 prompts: list[list[int]], echo: list[str]) -> None:
        super().__init__(serving, rid, req.n, len(prompts), sum(len(p) for p in prompts),
                         req.include_usage)
        self.req = req
        self.echo_pending = [bool(e) for e in echo for _ in range(req.n)]
        self.echo = [e for e in echo for _ in range(req.n)]
        for ch, e in zip(self.choices, self.echo):
            ch.offset = len(e)

    def top_logprobs_k(self) -> int:
        return self.req.logprobs or 0

    def delta_chunk(self, prompt_idx: int, out: Any, render: bool = True) -> str:
        parts = []
        for idx, c in self.absorb(prompt_idx, out):
            ch = self.choices[idx]
            text = c.text
            if self.echo_pending[idx]:
                text = self.echo[idx] + text
                self.echo_pending[idx] = False
            ch.text += text
            lp = self._logprobs(ch, c) if self.req.logprobs is not None else None
            parts.append({"index": idx, "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return self.chunk(parts) if render else ""

    def _logprobs(self, ch: _Choice, c: Any) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lps in zip(c.token_ids, c.logprobs or []):
            tok = self.serving.token_text(tid)
            tokens.append(tok)
            token_lps.append(max(lps.get(tid, _MIN_LOGPROB), _MIN_LOGPROB))
            tops.append({self.serving.token_text(t): max(v, _MIN_LOGPROB)
                         for t, v in self._ranked(lps)})
            offsets.append(ch.offset)
            ch.offset += len(tok)
        ch.lp_tokens += tokens
        ch.lp_token_logprobs += token_lps
        ch.lp_top += tops
        ch.lp_offsets += offsets
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def final(self) -> dict[str, Any]:
        choices = []
        for idx, ch in enumerate(self.choices):
            lp = None
            if self.req.logprobs is not None:
                lp = {"tokens": ch.lp_tokens, "token_logprobs": ch.lp_token_logprobs,
                      "top_logprobs": ch.lp_top, "text_offset": ch.lp_offsets}
            choices.append({"index": idx, "text": ch.text, "logprobs": lp,
                            "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason})
        return {"id": self.rid, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage()}


class _ChatBuilder(_Builder):
    object_name = "chat.completion.chunk"

    def __init__(self, serving: OpenAIServing, rid: str, req: ChatCompletionRequest,
                 prompt: list[int]) -> None:
        super().__init__(serving, rid, req.n, 1, len(prompt), req.include_usage)
        self.req = req

    def top_logprobs_k(self) -> int:
        return self.req.top_logprobs or 0

    def preamble(self) -> list[str]:
        # OpenAI opens every choice with a role-only delta.
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}
                            for i in range(self.n)])]

    def delta_chunk(self, prompt_idx: int, out: Any, render: bool = True) -> str:
        parts = []
        for idx, c in self.absorb(prompt_idx, out):
            ch = self.choices[idx]
            ch.text += c.text
            lp = None
            if self.req.logprobs:
                lp = {"content": self._logprobs(c)}
                ch.lp_content += lp["content"]
            delta = {"content": c.text} if c.text or c.finish_reason is None else {}
            parts.append({"index": idx, "delta": delta, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return self.chunk(parts) if render else ""

    def _logprobs(self, c: Any) -> list[dict[str, Any]]:
        entries = []
        for tid, lps in zip(c.token_ids, c.logprobs or []):
            tok = self.serving.token_text(tid)
            entries.append({
                "token": tok, "logprob": max(lps.get(tid, _MIN_LOGPROB), _MIN_LOGPROB),
                "bytes": list(tok.encode()),
                "top_logprobs": [{"token": (t := self.serving.token_text(i)),
                                  "logprob": max(v, _MIN_LOGPROB), "bytes": list(t.encode())}
                                 for i, v in self._ranked(lps)]})
        return entries

    def final(self) -> dict[str, Any]:
        choices = [{"index": idx, "message": {"role": "assistant", "content": ch.text},
                    "logprobs": {"content": ch.lp_content} if self.req.logprobs else None,
                    "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
                   for idx, ch in enumerate(self.choices)]
        return {"id": self.rid, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage()}


# ---- helpers ------------------------------------------------------------------------------


def _parse(model: type, body: bytes) -> Any:
    try:
        return model.model_validate_json(body or b"")
    except ValidationError as e:
        msg, param = validation_error_message(e.errors(include_url=False))
        raise RequestError(msg, param=param) from None


async def _tagged(idx: int, gen: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    try:
        async for out in gen:
            yield idx, out
    finally:
        await _aclose(gen)


async def _merge(gens: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several engine streams as (stream index, delta), in arrival order."""
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[Any]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out, None, False))
            await queue.put((i, None, None, True))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e, True))
        finally:
            await _aclose(gen)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(tasks)
        while live:
            i, out, err, done = await queue.get()
            if err is not None:
                raise err
            if done:
                live -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _first(stream: AsyncIterator[tuple[int, Any]]) -> tuple[int, Any] | None:
    """Wait for the first delta, so errors before any output become a proper HTTP status."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None
    except BaseException:
        await _aclose(stream)
        raise


async def _aclose(gen: Any) -> None:
    close = getattr(gen, "aclose", None)
    if close is not None:
        await close()



async def _respond(builder: Any, first: Any, stream: Any, streaming: bool) -> Response:
    """SSE for a streaming request, else the whole body once the engine is done."""
    if streaming:
        return _sse(builder.stream(first, stream))
    try:
        return JSONResponse(await builder.collect(first, stream))
    except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
        return _error_response(_map_exception(e))

def _sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _message(e: BaseException) -> str:
    cause = getattr(e, "cause", None)  # RayTaskError wraps the replica's exception
    return str(cause if isinstance(cause, BaseException) else e).strip() or type(e).__name__


def _map_exception(e: BaseException) -> RequestError:
    """The HTTP status and OpenAI error for any failure while serving a request."""
    if isinstance(e, RequestError):
        return e
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and cause is not e:
        return _map_exception(cause)
    status = getattr(e, "status_code", None)
    if status in (429, 503):  # Serve's BackPressureError, or an engine queue cap
        return RequestError(
            f"the server is overloaded: {_message(e).rstrip('.')}; retry later", status=status,
            err_type="server_overloaded",
            code="rate_limit_exceeded" if status == 429 else "service_unavailable",
            retry_after=getattr(e, "retry_after_s", None) or DEFAULT_RETRY_AFTER_S)
    if isinstance(e, ValueError):
        return RequestError(_message(e))
    engine_err = _engine_error(e)
    if engine_err is not None:
        return engine_err
    logger.exception("request failed", exc_info=e)
    return RequestError(f"internal server error: {type(e).__name__}: {_message(e)}",
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


def _error_response(err: RequestError) -> JSONResponse:
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    return JSONResponse(err.body(), status_code=err.status, headers=headers)
