"""Streaming text: incremental detokenization and stop-string detection (the output
processor's, cluster/engine/output_processor.py).

Both work on a bounded window, so the per-token cost does not grow with the sequence.
The tokenizer is duck-typed (a Hugging Face tokenizer: `convert_ids_to_tokens`,
`convert_tokens_to_string`, `__len__`); this module never imports transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens kept as left context so the
# first output token is spelled as it would be mid-text (leading spaces, merges).
INITIAL_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


# (prompt_token_ids, skip_special_tokens) -> a new sequence's detokenizer: any object with
# IncrementalDetokenizer's `step(token_id) -> str` and `flush() -> str`.
DetokenizerFactory = Callable[[Sequence[int], bool], Any]


class IncrementalDetokenizer:
    """vLLM's prefix_offset / read_offset algorithm over a trimmed token window.

    Invariants: `tokens[prefix_offset:read_offset]` is the context whose text has already been
    emitted (kept so the next token is spelled in context); `tokens[read_offset:]` are tokens
    whose text is not emitted yet, because it ends in U+FFFD (an incomplete UTF-8 character)
    or is empty. Tokens before `prefix_offset` are dropped, so `tokens` stays a few entries
    long however long the sequence grows.
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "tokens", "prefix_offset", "read_offset",
                 "_prefix_text", "_vocab_size", "_cache")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True,
                 token_cache: dict[int, list[str]] | None = None) -> None:
        """`token_cache` maps token id -> its tokens under this skip_special_tokens setting; it
        may be shared by every detokenizer of one tokenizer (convert_ids_to_tokens is the
        slowest call here)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._cache = {} if token_cache is None else token_cache
        tail = list(prompt_token_ids[-(INITIAL_OFFSET + 2):])
        self.tokens: list[str] = list(tokenizer.convert_ids_to_tokens(
            tail, skip_special_tokens=skip_special_tokens))
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - INITIAL_OFFSET, 0)
        self._prefix_text: str | None = None  # text of tokens[prefix_offset:read_offset]
        self._vocab_size = len(tokenizer)

    def step(self, token_id: int) -> str:
        """Add one token; return the new text it completes ("" while a character is incomplete)."""
        tok = self.tokenizer
        new_tokens = self._cache.get(token_id)
        if new_tokens is None:
            if 0 <= token_id < self._vocab_size:
                new_tokens = tok.convert_ids_to_tokens(
                    [token_id], skip_special_tokens=self.skip_special_tokens)
                if isinstance(new_tokens, str):
                    new_tokens = [new_tokens]
            else:
                new_tokens = []  # out of vocabulary: no text (vLLM does the same)
            self._cache[token_id] = new_tokens
        self.tokens.extend(new_tokens)
        if self._prefix_text is None:
            self._prefix_text = tok.convert_tokens_to_string(
                self.tokens[self.prefix_offset:self.read_offset])
        prefix_text = self._prefix_text
        new_text = tok.convert_tokens_to_string(self.tokens[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        # The emitted tokens become the next context (prefix_offset moves to read_offset) and
        # everything before them is dropped.
        del self.tokens[:self.read_offset]
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self._prefix_text = None
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Text of the tokens still held back (it may end in U+FFFD); called once, at the end."""
        if self.read_offset >= len(self.tokens):
            return ""
        tok = self.tokenizer
        prefix_text = tok.convert_tokens_to_string(self.tokens[self.prefix_offset:self.read_offset])
        new_text = tok.convert_tokens_to_string(self.tokens[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.tokens)
        self._prefix_text = None
        return new_text[len(prefix_text):]


class StopStringBuffer:
    """Finds stop strings in streamed text, looking back only max(len(stop)) - 1 characters.

    Unless `include_in_output`, the last max(len(stop)) - 1 characters are held back, so text
    already streamed never has to be taken back when a stop string completes later.
    Invariants: `window` is the last (at most) max_len - 1 characters seen; its last `held`
    characters have not been emitted.
    """

    __slots__ = ("stop", "include_in_output", "max_len", "window", "held")

    def __init__(self, stop: Sequence[str], include_in_output: bool = False) -> None:
        self.stop = list(stop)
        self.include_in_output = include_in_output
        self.max_len = max(len(s) for s in self.stop)
        self.window = ""
        self.held = 0

    def feed(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """Add new text; return (text to emit now, the stop string that ended it or None).

        A match must end inside `text` (earlier ones were seen before). On a match the emitted
        text stops before the stop string, or after it with include_in_output; the caller then
        finishes the sequence and never feeds this buffer again.
        """
        window = self.window
        combined = window + text
        emit_from = len(window) - self.held
        if check and text:
            best, best_at = None, len(combined)
            for s in self.stop:
                at = combined.find(s, max(0, len(window) - len(s) + 1))
                if at != -1 and at < best_at:
                    best, best_at = s, at
            if best is not None:
                end = best_at + len(best) if self.include_in_output else best_at
                self.held = 0
                return combined[emit_from:max(end, emit_from)], best
        keep = self.max_len - 1
        hold = 0 if self.include_in_output else keep
        emit_to = max(emit_from, len(combined) - hold)
        self.window = combined[-keep:] if keep else ""
        self.held = len(combined) - emit_to
        return combined[emit_from:emit_to], None

    def flush(self) -> str:
        """The held-back text, when the sequence ends for another reason."""
        held, self.held = self.held, 0
        return self.window[len(self.window) - held:] if held else ""
