"""Prompts in, token ids out: tokenization, chat-template rendering and length checks.

Invariants: every id list returned here is non-empty and inside the vocabulary, and every
max_tokens fits the context next to its prompt, so nothing a client sends can crash a worker.
A text that cannot fit the context whatever its tokenization (more bytes than
`max_token_bytes` times the context) is refused before it is tokenized, so a huge prompt costs
a length check, not seconds of tokenizer time. The methods here are synchronous and may take
long on big prompts: the HTTP layer runs them off its event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cluster.api.protocol import ChatCompletionRequest, CompletionRequest, RequestError

# Arguments of apply_chat_template that the request's own fields (or this server) set.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "tokenize", "return_dict", "tokenizer",
                                       "add_generation_prompt", "continue_final_message",
                                       "tools"})


class PromptProcessor:
    """Request prompts -> validated token ids, and token ids -> text for logprobs and echo."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_token_bytes = max_token_bytes(tokenizer)
        self._token_text: dict[int, str] = {}
        self._encode = text_encoder(tokenizer)

    def completion_prompts(self, prompt: Any, max_model_len: int) -> list[list[int]]:
        """/v1/completions' `prompt` (a string, ids, or a batch of either) as id lists."""
        if isinstance(prompt, str):
            batch: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            batch = [prompt]
        else:
            batch = list(prompt)
        if not batch:
            raise RequestError("prompt is empty; send a string or a list of token ids",
                               param="prompt")
        return [self.check_ids(self.encode(p, max_model_len, "prompt") if isinstance(p, str)
                               else p, "prompt") for p in batch]

    def render_chat(self, req: ChatCompletionRequest, max_model_len: int) -> list[int]:
        """The messages rendered through the model's chat template, tokenized."""
        kwargs = dict(req.chat_template_kwargs or {})
        bad = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if bad:
            raise RequestError(f"chat_template_kwargs may not set {bad}; use the request's own "
                               "fields for them", param="chat_template_kwargs")
        if req.continue_final_message and req.add_generation_prompt:
            raise RequestError("continue_final_message needs add_generation_prompt: false",
                               param="continue_final_message")
        for i, m in enumerate(req.messages):
            if m.content is None and not getattr(m, "tool_calls", None):
                raise RequestError(f"messages[{i}] ({m.role}) has neither content nor tool_calls; "
                                   "send its text as content", param="messages")
        req.check_tools()
        messages = [m.to_template_dict() for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=req.tool_dicts() if req.uses_tools else None, tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, **kwargs)
        except Exception as e:  # noqa: BLE001 - template errors are the client's messages
            raise RequestError(f"the chat template rejected the messages: {e}",
                               param="messages") from None
        return self.check_ids(self.encode(text, max_model_len, "messages"), "messages")

    def encode(self, text: str, max_model_len: int, param: str) -> list[int]:
        """`text`'s token ids; a text too long for any tokenization to fit is refused untokenized."""
        num_bytes = len(text.encode())
        at_least = -(-num_bytes // self.max_token_bytes)
        if at_least >= max_model_len:  # not even one completion token would fit
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, the "
                f"{num_bytes} bytes of text in `{param}` make at least {at_least} tokens. Please "
                "reduce the length of the prompt.", param=param)
        return self._encode(text)

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise RequestError(f"{param} is empty after tokenization; send at least one token",
                               param=param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                               param=param)
        return ids

    @staticmethod
    def max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
        """`requested`, or all the room the context has left when None; 400 if it does not fit."""
        if requested is not None and requested < 1:
            raise RequestError(f"max_tokens must be an integer >= 1; got {requested}",
                               param="max_tokens")
        room = max_model_len - prompt_len
        if room < 1 or (requested is not None and requested > room):
            want = prompt_len + (requested or 1)
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"you requested {want} tokens ({prompt_len} in the prompt, {requested or 1} in "
                "the completion). Please reduce the length of the prompt or completion.",
                param="max_tokens")
        return room if requested is None else requested

    def echo_text(self, prompt: list[int], req: CompletionRequest) -> str:
        if not req.echo:
            return ""
        return self.tokenizer.decode(prompt, skip_special_tokens=req.skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, cached: logprobs ask for the same few tokens on every step."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


def text_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """`text -> ids` without special tokens added: the tokenizer's Rust backend called directly
    (`encode_batch_fast`: no offsets computed) when it gives transformers' `encode`'s ids on
    probe texts (special tokens, whitespace runs, multi-byte characters), else that `encode`.
    transformers' layers around the backend cost more than the tokenization itself: a
    256-token prompt 0.9 ms against 0.34 ms (docs/benchmarks.md, issue #43)."""
    def slow(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    batch = getattr(getattr(tokenizer, "backend_tokenizer", None), "encode_batch_fast", None)
    if batch is None:
        return slow

    def fast(text: str) -> list[int]:
        return batch([text], add_special_tokens=False)[0].ids

    added = "".join(sorted(tokenizer.get_added_vocab())[:8])
    probes = ("", "hello world", "  two  spaces\n\n\ttab ", "héllo wörld 你好 🙂 \u2581x",
              f"{added}user\nhi {added}", "x" * 300)
    try:
        same = all(fast(p) == slow(p) for p in probes)
    except Exception:  # noqa: BLE001 - a backend that cannot say: the checked path
        same = False
    return fast if same else slow


def max_token_bytes(tokenizer: Any) -> int:
    """The most bytes of UTF-8 text one token of `tokenizer` stands for (an upper bound).

    A vocabulary entry's UTF-8 length bounds the text it decodes to (SentencePiece's "\u2581"
    is one space; a byte-fallback "<0xE4>" is one byte). Byte-level BPE (GPT-2, Qwen) spells
    each byte as one character, so there the character count is the exact byte count; added
    tokens are stored as their text.
    """
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = type(decoder).__name__ == "ByteLevel"
    added = set(tokenizer.get_added_vocab())
    return max((len(tok) if byte_level and tok not in added else len(tok.encode()))
               for tok in tokenizer.get_vocab())
