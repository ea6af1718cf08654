"""Incremental detokenization in Rust: the engine's detokenizer for Hugging Face fast tokenizers.

`cluster.engine.detokenizer.IncrementalDetokenizer` spells tokens through the tokenizer's Python
API (two `convert_tokens_to_string` calls per token, and a `convert_ids_to_tokens` call for a
token id not seen before). `tokenizers.decoders.DecodeStream` does the same prefix/read-offset
algorithm in Rust, several times faster for any id (docs/benchmarks.md, Scheduler), which is
what a 256-sequence decode step needs. The engine hands the output processor
`detokenizer_factory(tokenizer)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

from cluster.engine.detokenizer import INITIAL_OFFSET


class StreamDetokenizer:
    """`step(token_id) -> new text`, `flush() -> held-back text`, as IncrementalDetokenizer.

    Invariants: `_context` are the last ids whose text was emitted (the left context for
    flush), `_pending` the ids stepped since then whose text is not out yet (an incomplete
    UTF-8 character, or a skipped special token). Ids outside the vocabulary give no text and
    never reach the stream (vLLM does the same).
    """

    __slots__ = ("_backend", "_skip", "_stream", "_context", "_pending", "_vocab_size")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._skip = skip_special_tokens
        self._vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        tail = [t for t in prompt_token_ids[-INITIAL_OFFSET:] if 0 <= t < self._vocab_size]
        # Primed with the prompt's tail so the first output token is spelled mid-text.
        self._stream = DecodeStream(ids=tail, skip_special_tokens=skip_special_tokens)
        self._context = tail
        self._pending: list[int] = []

    def step(self, token_id: int) -> str:
        if not 0 <= token_id < self._vocab_size:
            return ""
        piece = self._stream.step(self._backend, token_id)
        pending = self._pending
        pending.append(token_id)
        if piece is None:
            return ""
        self._context, self._pending = pending, []
        return piece

    def flush(self) -> str:
        """Text of the ids still held back, as tokenizer.decode spells them (U+FFFD for an
        incomplete character); called once, when the sequence ends."""
        if not self._pending:
            return ""
        decode, skip = self._backend.decode, self._skip
        before = decode(self._context, skip_special_tokens=skip)
        text = decode(self._context + self._pending, skip_special_tokens=skip)
        self._context, self._pending = self._context + self._pending, []
        return text[len(before):]


def detokenizer_factory(tokenizer: Any) -> Callable[[Sequence[int], bool], Any] | None:
    """The factory the Scheduler takes for this tokenizer: StreamDetokenizer for a Hugging
    Face fast tokenizer, None (the scheduler's own IncrementalDetokenizer) otherwise."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return None

    def make(prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> StreamDetokenizer:
        return StreamDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)

    return make
