"""The engine's `RequestOutput` deltas as OpenAI response bodies and SSE chunks.

A builder follows one HTTP request: `stream` yields the SSE chunks as deltas arrive,
`collect` waits for the end and returns the whole body. Responses are plain dicts with one
`json.dumps` per chunk (the hot path). A chat response runs each choice's text through the
server's reasoning parser (`reasoning_content`) and, when the request has tools, its tool-call
parser (`tool_calls`), streamed or whole alike. Invariants: an SSE stream always ends with
`data: [DONE]`, an error after the headers went out is sent in-band as an error chunk, and
the engine stream is closed however the builder stops reading it.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.api.async_streams import aclose
from cluster.api.openai_errors import error_response, map_exception
from cluster.api.protocol import ChatCompletionRequest, CompletionRequest
from cluster.engine.reasoning import REASONING_PARSERS
from cluster.engine.tool_parsers import TOOL_CALL_PARSERS

# JSON has no -inf; vLLM reports impossible tokens with this value instead.
_MIN_LOGPROB = -9999.0


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


class ResponseBuilder(ABC):
    """One request's response; choice `prompt_idx * n + c.index` is sample c of that prompt."""

    object_name = ""

    def __init__(self, model: str | None, token_text: Callable[[int], str], rid: str, n: int,
                 num_prompts: int, prompt_tokens: int, include_usage: bool) -> None:
        self.token_text = token_text
        self.rid = rid
        self.n = n
        self.created = int(time.time())
        self.model = model
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

    @abstractmethod
    def delta_chunk(self, prompt_idx: int, out: Any, render: bool = True) -> str:
        """Absorb one delta; its SSE chunk when `render`, else ""."""

    @abstractmethod
    def final(self) -> dict[str, Any]:
        """The whole non-streaming response body, once every delta is absorbed."""

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
            yield f"data: {json.dumps(map_exception(e, self.rid).body())}\n\n"
        finally:
            await aclose(rest)
        yield "data: [DONE]\n\n"

    async def collect(self, first: tuple[int, Any] | None,
                      rest: AsyncIterator[tuple[int, Any]]) -> dict[str, Any]:
        try:
            if first is not None:
                self.delta_chunk(*first, render=False)
                async for prompt_idx, out in rest:
                    self.delta_chunk(prompt_idx, out, render=False)
        finally:
            await aclose(rest)
        return self.final()

    def preamble(self) -> list[str]:
        return []


class CompletionBuilder(ResponseBuilder):
    object_name = "text_completion"

    def __init__(self, model: str | None, token_text: Callable[[int], str], rid: str,
                 req: CompletionRequest, prompts: list[list[int]], echo: list[str]) -> None:
        super().__init__(model, token_text, rid, req.n, len(prompts),
                         sum(len(p) for p in prompts), req.include_usage)
        self.req = req
        self.prompts = prompts
        self.first_pending = [True] * (req.n * len(prompts))  # no delta of the choice yet
        self.echo = [e for e in echo for _ in range(req.n)]
        # each prompt's prompt logprobs, from its first output (SamplingParams.prompt_logprobs)
        self.prompt_logprobs: list[list[dict[int, Any] | None] | None] = [None] * len(prompts)
        # echo with logprobs: the prompt's tokens come first in the logprobs, offsets from 0
        self.echo_logprobs = req.echo and req.logprobs is not None
        for ch, e in zip(self.choices, self.echo):
            ch.offset = 0 if self.echo_logprobs else len(e)

    def top_logprobs_k(self) -> int:
        return self.req.logprobs or 0

    def delta_chunk(self, prompt_idx: int, out: Any, render: bool = True) -> str:
        parts = []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_idx] = out.prompt_logprobs
        echo_only = self.req.echo_only
        for idx, c in self.absorb(prompt_idx, out):
            ch = self.choices[idx]
            text = "" if echo_only else c.text
            token_ids = [] if echo_only else c.token_ids
            token_lps = [] if echo_only else c.logprobs or []
            part: dict[str, Any] = {"index": idx}
            if echo_only:
                ch.num_tokens = 0  # the one generated token is not part of the answer
            if self.first_pending[idx]:  # the prompt's part comes first
                self.first_pending[idx] = False
                text = self.echo[idx] + text
                prompt = self.prompts[prompt_idx]
                prompt_lps = self.prompt_logprobs[prompt_idx]
                if self.echo_logprobs:
                    token_ids = prompt + token_ids
                    token_lps = _plain(prompt_lps, len(prompt)) + token_lps
                if self.req.prompt_logprobs is not None:
                    part["prompt_logprobs"] = _vllm_prompt_logprobs(prompt_lps)
            ch.text += text
            lp = self._logprobs(ch, token_ids, token_lps) if self.req.logprobs is not None else None
            part.update({"text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason})
            parts.append(part)
        return self.chunk(parts) if render else ""

    def _logprobs(self, ch: _Choice, token_ids: list[int],
                  logprobs: list[dict[int, float] | None]) -> dict[str, Any]:
        """OpenAI's legacy logprobs of these tokens; an entry None (a prompt's first token)
        has null token_logprobs and top_logprobs."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lps in zip(token_ids, logprobs):
            tok = self.token_text(tid)
            tokens.append(tok)
            if lps is None:
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(max(lps.get(tid, _MIN_LOGPROB), _MIN_LOGPROB))
                tops.append({self.token_text(t): max(v, _MIN_LOGPROB)
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
            choice = {"index": idx, "text": ch.text, "logprobs": lp,
                      "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
            if self.req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(
                    self.prompt_logprobs[idx // self.n])
            choices.append(choice)
        return {"id": self.rid, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage()}


def _plain(prompt_logprobs: list[dict[int, Any] | None] | None,
           length: int) -> list[dict[int, float] | None]:
    """Prompt logprobs ({id: Logprob}) as the completion's ({id: value}); all None when the
    engine sent none (a request whose first output finished it without a token)."""
    if prompt_logprobs is None:
        return [None] * length
    return [None if e is None else {t: lp.logprob for t, lp in e.items()}
            for e in prompt_logprobs]


def _vllm_prompt_logprobs(prompt_logprobs: list[dict[int, Any] | None] | None
                          ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` of a completion choice: per prompt token, null first, then
    {token id: {logprob, rank, decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [None if e is None else {
        str(t): {"logprob": max(lp.logprob, _MIN_LOGPROB), "rank": lp.rank,
                 "decoded_token": lp.decoded_token} for t, lp in e.items()}
        for e in prompt_logprobs]


class _Parsed:
    """One chat choice's text through the reasoning and tool-call parsers."""

    __slots__ = ("reasoner", "tools", "reasoning", "content", "calls", "reasoning_tokens")

    def __init__(self, reasoner: Any, tools: Any) -> None:
        self.reasoner = reasoner
        self.tools = tools
        self.reasoning = ""
        self.content = ""
        self.calls: list[dict[str, Any]] = []
        self.reasoning_tokens = 0

    def feed(self, c: Any) -> dict[str, Any]:
        """The delta of one CompletionOutput: reasoning_content, content and tool_calls parts
        (the calls with their index in this choice)."""
        text, reasoning = c.text, ""
        done = c.finish_reason is not None
        if self.reasoner is not None:
            reasoning, text = self.reasoner.feed(text)
            if self.reasoner.last_in_reasoning:
                self.reasoning_tokens += len(c.token_ids)
            if done:
                r, t = self.reasoner.finish()
                reasoning, text = reasoning + r, text + t
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if done:
                t, more = self.tools.finish()
                text, calls = text + t, calls + more
        delta: dict[str, Any] = {}
        if reasoning:
            self.reasoning += reasoning
            delta["reasoning_content"] = reasoning
        if text:
            self.content += text
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [{"index": len(self.calls) + i, **call}
                                   for i, call in enumerate(calls)]
            self.calls += calls
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        # OpenAI's reason for an answer that is tool calls
        return "tool_calls" if reason == "stop" and self.calls else reason

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.reasoner is not None:
            msg["reasoning_content"] = self.reasoning if self.reasoner.opened else None
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg


class ChatBuilder(ResponseBuilder):
    object_name = "chat.completion.chunk"

    def __init__(self, model: str | None, token_text: Callable[[int], str], rid: str,
                 req: ChatCompletionRequest, prompt: list[int], reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None) -> None:
        super().__init__(model, token_text, rid, req.n, 1, len(prompt), req.include_usage)
        self.req = req
        self.reasoning = reasoning_parser is not None
        self.parsed: list[_Parsed] | None = None
        tools = tool_call_parser is not None and req.uses_tools
        if self.reasoning or tools:
            self.parsed = [_Parsed(
                REASONING_PARSERS[reasoning_parser](req.thinking) if self.reasoning else None,
                TOOL_CALL_PARSERS[tool_call_parser]() if tools else None)
                for _ in range(req.n)]

    def top_logprobs_k(self) -> int:
        return self.req.top_logprobs or 0

    def usage(self) -> dict[str, Any]:
        usage = super().usage()
        if self.reasoning and self.parsed is not None:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": sum(p.reasoning_tokens for p in self.parsed)}
        return usage

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
            reason = c.finish_reason
            if self.parsed is None:
                delta = {"content": c.text} if c.text or reason is None else {}
            else:
                parsed = self.parsed[idx]
                delta = parsed.feed(c)
                if not delta and reason is None:
                    delta = {"content": ""}
                reason = ch.finish_reason = parsed.finish_reason(reason)
            parts.append({"index": idx, "delta": delta, "logprobs": lp,
                          "finish_reason": reason, "stop_reason": c.stop_reason})
        return self.chunk(parts) if render else ""

    def _logprobs(self, c: Any) -> list[dict[str, Any]]:
        entries = []
        for tid, lps in zip(c.token_ids, c.logprobs or []):
            tok = self.token_text(tid)
            entries.append({
                "token": tok, "logprob": max(lps.get(tid, _MIN_LOGPROB), _MIN_LOGPROB),
                "bytes": list(tok.encode()),
                "top_logprobs": [{"token": (t := self.token_text(i)),
                                  "logprob": max(v, _MIN_LOGPROB), "bytes": list(t.encode())}
                                 for i, v in self._ranked(lps)]})
        return entries

    def final(self) -> dict[str, Any]:
        choices = []
        for idx, ch in enumerate(self.choices):
            message = ({"role": "assistant", "content": ch.text} if self.parsed is None
                       else self.parsed[idx].message())
            choices.append({"index": idx, "message": message,
                            "logprobs": {"content": ch.lp_content} if self.req.logprobs else None,
                            "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason})
        return {"id": self.rid, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage()}


async def respond(builder: ResponseBuilder, first: tuple[int, Any] | None,
                  stream: AsyncIterator[tuple[int, Any]], streaming: bool) -> Response:
    """SSE for a streaming request, else the whole body once the engine is done."""
    if streaming:
        return StreamingResponse(builder.stream(first, stream), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        return JSONResponse(await builder.collect(first, stream))
    except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
        return error_response(map_exception(e, builder.rid))
