"""OpenAI request bodies (with vLLM's extras), their mapping onto SamplingParams, and error bodies.

Request models are strict: a JSON value of the wrong type (`"max_tokens": "ten"`,
`"stream": 1`) is a 400, never coerced. Fields OpenAI clients send that this server does
not use (`user`, `logit_bias` left empty, ...) are ignored, as vLLM does; fields whose
meaning we cannot honour (`suffix`, `tools`, prompt logprobs) are rejected with a 400
naming the field, so a client never silently gets something else than it asked for.
Responses are built as plain dicts in `openai_responses.py`: one `json.dumps` per SSE chunk is
the hot path, and pydantic models there would only add latency.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler.sampling_params import SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's)."""

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

    def _sampling_kwargs(self) -> dict[str, Any]:
        if self.logit_bias:
            raise RequestError("logit_bias is not supported by this server; remove it",
                               param="logit_bias")
        kw: dict[str, Any] = {
            "n": self.n, "seed": self.seed, "stop": self.stop or [],
            "stop_token_ids": self.stop_token_ids or [], "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:  # None means "the default", as in OpenAI's API
                kw[name] = value
        return kw

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is a string, a token id list, or a batch of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.suffix:
            raise RequestError("suffix is not supported by this server; remove it",
                               param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(f"best_of ({self.best_of}) must equal n ({self.n}) or be omitted",
                               param="best_of")
        if self.echo and self.logprobs is not None:
            raise RequestError("echo together with logprobs needs prompt logprobs, which this "
                               "server does not compute; drop one of them", param="echo")
        return _make_params(**self._sampling_kwargs(), max_tokens=max_tokens,
                            logprobs=self.logprobs)


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    reasoning_content: str | None = None

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
        return msg


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
    tools: list[dict[str, Any]] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when both are sent.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.tools:
            raise RequestError("tools are not supported by this server; remove them",
                               param="tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return _make_params(**self._sampling_kwargs(), max_tokens=max_tokens, logprobs=logprobs)


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
