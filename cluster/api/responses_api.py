"""OpenAI's Responses API (`POST /v1/responses`) for text models, as vLLM serves it.

(Not to be confused with openai_responses.py, which builds the bodies of the chat and
completions routes.) A Responses request is translated into a `ChatCompletionRequest`
(`ResponsesRequest.to_chat`): `input` (a string, or a list of messages, `function_call` and
`function_call_output` items) with `instructions` as a system message first; `tools` and
`tool_choice` in the chat shape (the hermes parser finds the calls); `text.format` as
`response_format` (xgrammar); `reasoning.effort: "none"` as Qwen3's `enable_thinking: false`.
So rendering, limits, sampling and constraints are the chat route's, unchanged.

The engine's deltas go through the same reasoning and tool-call parsers as chat
(`openai_responses._Parsed`) and come out as Responses output items: a `reasoning` item
(content `reasoning_text`), a `message` item (content `output_text`) and one `function_call`
item per call, in the order the model produced them. Streamed, they are the Responses API's
events (`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`, the matching `.done` events, then
`response.completed`, or `response.incomplete` when `max_output_tokens` cut the answer),
each with its `sequence_number`; the official client's `responses.stream` assembles them.

Invariants: unknown fields are a 400 naming the field, as on the other routes; this server
keeps no responses, so `previous_response_id`, `store: true` and `background: true` are a
400 that says so (send the conversation in `input`); an item's id is the same in its
`.added`, `.done` and final events.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field, ValidationError

from cluster.api.async_streams import aclose, first_delta
from cluster.api.lora_models import request_lora
from cluster.api.openai_errors import error_response, map_exception
from cluster.api.openai_responses import _Parsed
from cluster.api.protocol import (
    HARMLESS_FIELDS,
    ChatCompletionRequest,
    RequestError,
    _Request,
    validation_error_message,
)
from cluster.engine.reasoning import REASONING_PARSERS
from cluster.engine.tool_parsers import TOOL_CALL_PARSERS


class ResponsesTool(_Request):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedTool(_Request):
    type: Literal["function"]
    name: str


class ReasoningConfig(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None  # no summaries: the reasoning text itself is returned


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Request):
    """POST /v1/responses (OpenAI's fields, then vLLM's sampling extras)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop input silently
    include: list[str] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        unknown = sorted(set(self.model_extra or ()) - HARMLESS_FIELDS)
        if unknown:
            raise RequestError(f"unknown field {unknown[0]!r}: this server does not support it; "
                               "remove it", param=unknown[0])
        for name, value in (("previous_response_id", self.previous_response_id),
                            ("store", self.store or None), ("background", self.background or None)):
            if value is not None:
                raise RequestError(f"{name} is not supported: this server keeps no responses; "
                                   "send the whole conversation in `input` (and store: false or "
                                   "no store)", param=name)
        if self.include:
            raise RequestError(f"include {self.include} is not supported; send no include",
                               param="include")

    @property
    def thinking(self) -> bool:
        if self.reasoning is not None and self.reasoning.effort == "none":
            return False
        return (self.chat_template_kwargs or {}).get("enable_thinking", True) is not False

    def to_chat(self) -> ChatCompletionRequest:
        """The same request as /v1/chat/completions takes it (400s name Responses' fields)."""
        self.check()
        kwargs = dict(self.chat_template_kwargs or {})
        if not self.thinking:
            kwargs["enable_thinking"] = False
        body: dict[str, Any] = {
            "messages": self._messages(), "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "seed": self.seed, "parallel_tool_calls": self.parallel_tool_calls,
            "chat_template_kwargs": kwargs or None,
        }
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, ResponsesNamedTool):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise RequestError("text.format of type json_schema needs a schema",
                                   param="text")
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            msg, param = validation_error_message(e.errors(include_url=False))
            param = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                     "response_format": "text"}.get(param or "", param)
            raise RequestError(f"{param}: {msg}", param=param) from None

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        if not self.input:
            raise RequestError("input is empty; send a string or a list of messages",
                               param="input")
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                messages.append({"role": item.get("role"),
                                 "content": _item_text(item.get("content"), i)})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": _item_text(item.get("output"), i)})
            elif kind != "reasoning":  # earlier reasoning: Qwen3's template drops it anyway
                raise RequestError(f"input[{i}] has type {kind!r}; this server takes messages, "
                                   "function_call and function_call_output items", param="input")
        return messages


def _item_text(content: Any, i: int) -> str:
    """A message's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict)
                 and p.get("type") in ("input_text", "output_text", "text")]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise RequestError(f"input[{i}]: content must be a string or a list of input_text parts "
                       "(this server serves a text model)", param="input")


class ResponsesBuilder:
    """One request's Responses output: its items, its events when streamed, its final body."""

    def __init__(self, model: str | None, rid: str, req: ResponsesRequest,
                 chat: ChatCompletionRequest, prompt_tokens: int,
                 reasoning_parser: str | None, tool_call_parser: str | None) -> None:
        self.rid = rid
        self.model = model
        self.req = req
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.output_tokens = 0
        self.finish_reason: str | None = None
        tools = tool_call_parser is not None and chat.uses_tools
        self.parsed = _Parsed(
            REASONING_PARSERS[reasoning_parser](chat.thinking) if reasoning_parser else None,
            TOOL_CALL_PARSERS[tool_call_parser]() if tools else None)
        self.reasoning = reasoning_parser is not None
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item being written
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        where = self._where(item)
        part = item["content"][0]
        if item["type"] == "reasoning":
            events = [self.event("response.reasoning_text.done", **where, content_index=0,
                                 text=part["text"])]
        else:
            events = [self.event("response.output_text.done", **where, content_index=0,
                                 text=part["text"], logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0,
                                 part=part)]
        return events + [self.event("response.output_item.done",
                                    output_index=where["output_index"], item=item)]

    def _write(self, kind: str, text: str) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                        "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                        "status": "in_progress", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.items.append(item)
            self.open = item
            events.append(self.event("response.output_item.added",
                                     output_index=len(self.items) - 1, item=dict(item)))
            item["content"] = [part]
            if kind == "message":
                events.append(self.event("response.content_part.added", **self._where(item),
                                         content_index=0, part=dict(part)))
        item = self.open
        item["content"][0]["text"] += text
        name = ("response.reasoning_text.delta" if kind == "reasoning"
                else "response.output_text.delta")
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self.event(name, **self._where(item), content_index=0, delta=text,
                                    **extra)]

    def _call(self, call: dict[str, Any]) -> list[str]:
        events = self._close()
        fn = call["function"]
        item = {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                "name": fn["name"], "arguments": "", "status": "in_progress"}
        self.items.append(item)
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                 item=dict(item)))
        item.update(arguments=fn["arguments"], status="completed")
        where = self._where(item)
        return events + [
            self.event("response.function_call_arguments.delta", **where,
                       delta=fn["arguments"]),
            self.event("response.function_call_arguments.done", **where, name=fn["name"],
                       arguments=fn["arguments"]),
            self.event("response.output_item.done", output_index=where["output_index"],
                       item=item)]

    def feed(self, out: Any) -> list[str]:
        """The events of one engine delta (one choice: n is 1 here)."""
        self.cached_tokens = out.num_cached_tokens or 0
        events: list[str] = []
        for c in out.outputs:
            self.output_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                self.finish_reason = c.finish_reason
            delta = self.parsed.feed(c)
            if delta.get("reasoning_content"):
                events += self._write("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._write("message", delta["content"])
            for call in delta.get("tool_calls", ()):
                events += self._call(call)
        return events

    def body(self, status: str) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format else None
        usage = {"input_tokens": self.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": self.cached_tokens},
                 "output_tokens": self.output_tokens,
                 "output_tokens_details": {"reasoning_tokens": self.parsed.reasoning_tokens},
                 "total_tokens": self.prompt_tokens + self.output_tokens}
        incomplete = status == "incomplete"
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": self.items if status != "in_progress" else [],
            "usage": usage if status != "in_progress" else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "tools": [{**t.model_dump(exclude_none=True)} for t in req.tools or ()],
            "tool_choice": (req.tool_choice.model_dump() if isinstance(
                req.tool_choice, ResponsesNamedTool) else req.tool_choice or "auto"),
            "parallel_tool_calls": req.parallel_tool_calls,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "reasoning": req.reasoning.model_dump() if req.reasoning else None,
            "previous_response_id": None, "store": False, "background": False,
            "truncation": "disabled", "metadata": (req.model_extra or {}).get("metadata") or {},
        }

    def _final_status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    async def stream(self, first: tuple[int, Any] | None,
                     rest: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.body("in_progress"))
        yield self.event("response.in_progress", response=self.body("in_progress"))
        try:
            if first is not None:
                for e in self.feed(first[1]):
                    yield e
                async for _, out in rest:
                    for e in self.feed(out):
                        yield e
            for e in self._close():
                yield e
            status = self._final_status()
            yield self.event(f"response.{status}", response=self.body(status))
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
            err = map_exception(e, self.rid).body()["error"]
            yield self.event("error", code=err["code"], message=err["message"],
                             param=err["param"])
        finally:
            await aclose(rest)

    async def collect(self, first: tuple[int, Any] | None,
                      rest: AsyncIterator[tuple[int, Any]]) -> dict[str, Any]:
        try:
            if first is not None:
                self.feed(first[1])
                async for _, out in rest:
                    self.feed(out)
            self._close()
        finally:
            await aclose(rest)
        return self.body(self._final_status())


async def create_response(serving: Any, request: Request) -> Response:
    """POST /v1/responses on `serving` (openai_api.OpenAIServing): the chat route's steps."""
    rid = f"resp_{uuid.uuid4().hex}"
    try:
        info, body, req = await serving._read(request, lambda _: ResponsesRequest)
        chat = req.to_chat()
        if chat.uses_tools and serving.tool_call_parser is None:
            raise RequestError("tools need the server's tool_call_parser setting (hermes for "
                               "Qwen3), which is off; ask for it or send no tools", param="tools")
        prompt = await serving._off_loop(len(body), serving.prompts.render_chat, chat,
                                         info.max_model_len)
        try:
            max_tokens = serving.prompts.max_tokens(chat.requested_max_tokens, len(prompt),
                                                    info.max_model_len)
        except RequestError as e:
            raise RequestError(e.message.replace("max_tokens", "max_output_tokens"),
                               param="max_output_tokens") from None
        params = chat.to_sampling_params(
            max_tokens, info.sampling_defaults,
            reasoning=serving.reasoning_parser is not None and chat.thinking)
        stream = serving._start([prompt], [params], rid, None, lora=request_lora(request))
        first = await first_delta(stream)
    except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
        return error_response(map_exception(e, rid))
    builder = ResponsesBuilder(serving.model_name(request), rid, req, chat, len(prompt),
                               serving.reasoning_parser, serving.tool_call_parser)
    if req.stream:
        return StreamingResponse(builder.stream(first, stream), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        return JSONResponse(await builder.collect(first, stream))
    except Exception as e:  # noqa: BLE001
        return error_response(map_exception(e, rid))
