"""OpenAI request bodies (with vLLM's extras), their mapping onto SamplingParams, and error bodies.

Request models are strict: a JSON value of the wrong type (`"max_tokens": "ten"`,
`"stream": 1`) is a 400, never coerced. Top-level fields this server does not know are a 400
naming the field, except the few that cannot change the output (`HARMLESS_FIELDS`: `user`,
`metadata`, ...), which are ignored; known fields whose meaning we cannot honour (`suffix`,
`best_of` other than n, ...) are a 400 too, so a client never silently gets something else than it
asked for. Constraints (`response_format`, vLLM's `guided_*` and `structured_outputs`, a
required or named `tool_choice`) become `SamplingParams.structured_outputs`.
Responses are built as plain dicts in `openai_responses.py`: one `json.dumps` per SSE chunk is
the hot path, and pydantic models there would only add latency.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler.sampling_params import SamplingParams, StructuredOutputsParams

# Top-level request fields that cannot change the output: accepted and ignored. Any other
# field the models below do not declare is a 400.
HARMLESS_FIELDS = frozenset({"user", "metadata", "store", "service_tier",
                             "safety_identifier", "prediction", "priority", "request_id"})


_STRUCTURED_OUTPUTS_FIELDS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams))


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced exactly


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # routes a conversation to one replica (prefix_router)
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # StructuredOutputsParams' fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _sampling_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """SamplingParams' arguments: the request's, then for what it leaves out (None) the
        server's `defaults` (the model's generation_config), then SamplingParams' own."""
        unknown = sorted(set(self.model_extra or ()) - HARMLESS_FIELDS)
        if unknown:
            raise RequestError(f"unknown field {unknown[0]!r}: this server does not support it; "
                               "remove it", param=unknown[0])
        kw: dict[str, Any] = {
            "n": self.n, "seed": self.seed, "stop": self.stop or [],
            "stop_token_ids": self.stop_token_ids or [], "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": self._logit_bias(),
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is None:  # None means "the default", as in OpenAI's API
                value = defaults.get(name)
            if value is not None:
                kw[name] = value
        return kw

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias, keyed by token ids sent as strings ("50256": -100)."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            if not key.isdigit():
                raise RequestError(f"logit_bias keys are token ids (integers >= 0, as strings); "
                                   f"got {key!r}", param="logit_bias")
            out[int(key)] = value
        return out

    def constraints(self) -> list[tuple[str, StructuredOutputsParams]]:
        """The output constraints the request asks for, each with the field that asked."""
        found: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise RequestError("response_format of type json_schema needs "
                                   "json_schema.schema", param="response_format")
            found.append(("response_format", {"json": fmt.json_schema.schema_}))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((name, {key: getattr(self, name)}))
        if self.structured_outputs is not None:
            unknown = sorted(set(self.structured_outputs) - set(_STRUCTURED_OUTPUTS_FIELDS))
            if unknown:
                raise RequestError(f"structured_outputs: unknown field {unknown[0]!r}; valid "
                                   f"ones: {list(_STRUCTURED_OUTPUTS_FIELDS)}",
                                   param="structured_outputs")
            found.append(("structured_outputs", self.structured_outputs))
        out = []
        for name, kwargs in found:
            try:
                out.append((name, StructuredOutputsParams(**kwargs)))
            except ValueError as e:
                raise RequestError(f"{name}: {e}", param=name) from None
        return out

    def _constraint(self, extra: list[tuple[str, StructuredOutputsParams]] = (),
                    reasoning: bool = False) -> StructuredOutputsParams | None:
        """The one constraint of the request (400 for two), with `reasoning` set."""
        found = self.constraints() + list(extra)
        if len(found) > 1:
            raise RequestError(f"{found[0][0]} and {found[1][0]} both constrain the output; "
                               "send one of them", param=found[1][0])
        if not found:
            return None
        spec = found[0][1]
        spec.reasoning = reasoning
        return spec

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is a string, a token id list, or a batch of either.

    `echo` with `logprobs: k` returns the prompt's tokens, with their log-probabilities and top
    k (SamplingParams.prompt_logprobs = k), before the completion's, as lm-evaluation-harness
    reads them; `echo` with `max_tokens: 0` returns the prompt alone (one token is generated
    and dropped, as vLLM does). vLLM's `prompt_logprobs: k` asks for them without echo (each
    choice's `prompt_logprobs`, vLLM's shape).
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None  # vLLM's extension

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the response is the prompt alone."""
        return self.echo and self.max_tokens == 0

    @property
    def generated_max_tokens(self) -> int | None:
        """max_tokens for the engine (an echo-only request generates one token, dropped)."""
        return 1 if self.echo_only else self.max_tokens

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: vLLM's field, else `logprobs` when echoing."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def to_sampling_params(self, max_tokens: int | None,
                           defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.suffix:
            raise RequestError("suffix is not supported by this server; remove it",
                               param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(f"best_of ({self.best_of}) must equal n ({self.n}) or be omitted",
                               param="best_of")
        return _make_params(**self._sampling_kwargs(defaults or {}), max_tokens=max_tokens,
                            logprobs=self.logprobs, prompt_logprobs=self.wanted_prompt_logprobs,
                            structured_outputs=self._constraint())


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: which call it answers

    def to_template_dict(self) -> dict[str, Any]:
        """The message as a chat template expects it (content parts joined into text)."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError("only text content parts ({'type': 'text', 'text': ...}) "
                                       f"are supported; got {part.get('type')!r}",
                                       param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        msg: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions, rendered through the model's own chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when both are sent.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def thinking(self) -> bool:
        """Whether the chat template lets the model think (Qwen3's `enable_thinking`)."""
        return (self.chat_template_kwargs or {}).get("enable_thinking", True) is not False

    @property
    def uses_tools(self) -> bool:
        """Whether the model is shown the tools and its calls are parsed."""
        return bool(self.tools) and self.tool_choice != "none"

    def check_tools(self) -> None:
        """400 for a tool_choice without tools or naming a tool that is not there, and for a
        tool message that answers no earlier call."""
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise RequestError("tool_choice needs tools; send the tools the model may call",
                               param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if choice.function.name not in names:
                raise RequestError(f"tool_choice names the function {choice.function.name!r}, "
                                   f"which is not in tools ({names})", param="tool_choice")
        call_ids: set[str] = set()
        for i, m in enumerate(self.messages):
            call_ids.update(c.id for c in m.tool_calls or ())
            if m.role == "tool" and m.tool_call_id not in call_ids:
                raise RequestError(f"messages[{i}] is a tool result whose tool_call_id "
                                   f"{m.tool_call_id!r} answers no earlier assistant tool call",
                                   param="messages")

    def to_sampling_params(self, max_tokens: int | None, defaults: dict[str, Any] | None = None,
                           reasoning: bool = False) -> SamplingParams:
        """`defaults`: see `_sampling_kwargs`. `reasoning`: the server parses reasoning and the
        model thinks, so a constrained output may open with its thinking block."""
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        extra = []
        if self.uses_tools and (self.tool_choice not in (None, "auto")
                                or not self.parallel_tool_calls):
            from cluster.engine.tool_parsers import tool_call_constraint

            try:
                extra.append(("tool_choice", tool_call_constraint(
                    self.tool_dicts(), self._xgrammar_tool_choice(), self.parallel_tool_calls)))
            except ValueError as e:
                raise RequestError(f"tools: {e}", param="tools") from None
        return _make_params(**self._sampling_kwargs(defaults or {}), max_tokens=max_tokens,
                            logprobs=logprobs,
                            structured_outputs=self._constraint(extra, reasoning))

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as the chat template (and xgrammar) take them."""
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    def _xgrammar_tool_choice(self) -> Any:
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return choice.model_dump()
        return choice or "auto"


class TokenizeRequest(_Request):
    """POST /tokenize with a prompt (vLLM's): its token ids as /v1/completions would see them."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """POST /tokenize with messages (vLLM's): the chat template's rendering, tokenized, as
    /v1/chat/completions would send it to the engine."""

    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


class RequestError(ValueError):
    """A client error with its HTTP status, serialised as OpenAI's error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 err_type: str = "invalid_request_error", code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds, sent as Retry-After on 429/503
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.param, self.code)


def error_body(message: str, err_type: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def _make_params(**kw: Any) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        # SamplingParams names the offending field first ("top_p must be ...").
        msg = str(e)
        field = msg.split(" ", 1)[0]
        raise RequestError(msg, param=field if field in kw else None) from None


def validation_error_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A one-line message and the offending top-level field, from pydantic's error list."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc) or "body"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid value')}{more}", (loc[0] if loc else None)
