"""Sampling parameters, with vLLM's names, defaults and validation.

`StructuredOutputsParams` is only the description of a constraint (plain data, checked for
shape here); compiling it into a grammar and enforcing it is cluster/engine/structured_output.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Greedy sampling is temperature below this; vLLM uses the same cut-off.
_GREEDY_EPS = 1e-5
# The most alternatives per token `logprobs` and `prompt_logprobs` may ask for (the workers'
# output buffers hold this many).
MAX_LOGPROBS = 20


# The fields of StructuredOutputsParams that say what the output must match; exactly one is set.
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class StructuredOutputsParams:
    """What a constrained output must match, with vLLM's names (`GuidedDecodingParams` before).

    Exactly one of: `json` (a JSON schema, as a dict or its JSON text), `regex` (the whole
    output matches it), `choice` (the output is one of these strings), `grammar` (an EBNF
    grammar with a `root` rule, or a Lark grammar), `json_object` (any JSON object),
    `structural_tag` (xgrammar's structural tag, as JSON text).
    `disable_any_whitespace`: JSON without whitespace between its tokens (otherwise a few
    characters of whitespace may separate them). `reasoning`: the output may open with one
    complete `<think>...</think>` block, unconstrained, before the constrained part (set by the
    server for a thinking model when its reasoning parser is on).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    reasoning: bool = False

    def __post_init__(self) -> None:
        set_ = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(set_) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(_CONSTRAINTS)}; got {set_ or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        _check(self.json is None or isinstance(self.json, (dict, bool)), "structured_outputs.json",
               self.json, "a JSON schema (an object)")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value != ""),
                   f"structured_outputs.{name}", value, "a non-empty string")
        if self.choice is not None:
            self.choice = list(self.choice)
            _check(bool(self.choice) and all(isinstance(c, str) and c for c in self.choice),
                   "structured_outputs.choice", self.choice, "a non-empty list of non-empty strings")
        _check(self.json_object in (None, True), "structured_outputs.json_object",
               self.json_object, "true or omitted")
        for name in ("disable_any_whitespace", "reasoning"):
            _check(isinstance(getattr(self, name), bool), f"structured_outputs.{name}",
                   getattr(self, name), "true or false")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of json, regex, choice, grammar, json_object,
        structural_tag."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))

    def key(self) -> str:
        """The constraint as canonical JSON text: equal for equal constraints (the compile
        cache's key)."""
        return json.dumps({self.kind: getattr(self, self.kind),
                           "disable_any_whitespace": self.disable_any_whitespace,
                           "reasoning": self.reasoning}, sort_keys=True, separators=(",", ":"))


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's output.

    Defaults match vLLM's `SamplingParams` (temperature 1.0, top_p 1.0, top_k 0 or -1 = off,
    max_tokens 16). Every field is checked in `__post_init__`; a bad value raises `ValueError`
    naming the field and the allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's prompt_logprobs: per prompt token (after the first) its log-probability under
    # the model's raw distribution and the top k alternatives (RequestOutput.prompt_logprobs).
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to its logit (before the
    # penalties, as vLLM applies it); -100 in effect bans a token, 100 all but forces it.
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrain the output to a JSON schema, regex, choice or grammar (None: unconstrained).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(0.0 <= self.temperature <= 100.0, "temperature", self.temperature, "[0, 100]")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "(0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "an integer >= 0 (0 or -1 disables it)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "[0, 1]")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed,
               "an integer or None")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "an integer >= 1 or None")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "a list of non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "a list of integers >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and not isinstance(value, bool)
                                     and 0 <= value <= MAX_LOGPROBS),
                   name, value, f"an integer in [0, {MAX_LOGPROBS}] or None")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
               "[-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               self.frequency_penalty, "[-2, 2]")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
               self.repetition_penalty, "(0, 2]")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict) and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                and isinstance(v, (int, float)) and not isinstance(v, bool) and -100 <= v <= 100
                for t, v in self.logit_bias.items()), "logit_bias", self.logit_bias,
                "a map of token ids (integers >= 0) to values in [-100, 100]")
            self.logit_bias = {t: float(v) for t, v in self.logit_bias.items()} or None
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def max_prompt_len(self, max_model_len: int) -> int:
        """The longest prompt this request may have: a generation request's leaves room for
        one output token within max_model_len (scheduler/request.py `check_prompt_fits`)."""
        return max_model_len - 1

    @property
    def uses_penalties(self) -> bool:
        """Whether the sampler adjusts this request's logits per token: a penalty or a logit
        bias (they are applied together, from one per-sequence slot on the worker)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.logit_bias is not None)


@dataclass(slots=True)
class PoolingSamplingParams(SamplingParams):
    """A pooling request's parameters (cluster/engine/pooling.py `pooling_params`): a prefill
    with max_tokens 1 whose one output is a placeholder, never computed (the workers' pooler
    returns a vector instead). No token is generated, so its prompt may fill max_model_len,
    as vLLM allows for pooling."""

    def max_prompt_len(self, max_model_len: int) -> int:
        return max_model_len


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}; got {value!r}")
