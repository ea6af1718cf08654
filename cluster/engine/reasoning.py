"""Reasoning parsers: a thinking model's output split into reasoning and answer.

`qwen3` (vLLM's `--reasoning-parser qwen3`): Qwen3 opens its output with `<think>`, thinks,
closes with `</think>`, then answers. Everything inside the block is reasoning, everything
after it content. An output that does not open with `<think>` is all content (the model
answered directly, or the prompt closed the block: `enable_thinking: false`); an output whose
block never closes (cut off by max_tokens) is all reasoning.

A parser follows one choice's text as it streams: `feed(delta)` returns what is certain so
far, holding back only what could still be the start of a tag, and `finish()` returns the
rest. Feeding a text whole or in any pieces gives the same reasoning and content.
"""

from __future__ import annotations

THINK_BEGIN = "<think>"
THINK_END = "</think>"

_START, _THINK, _CONTENT = 0, 1, 2


class Qwen3ReasoningParser:
    """One choice's `<think>...</think>` split (see the module docstring).

    `thinking=False` (the request's `chat_template_kwargs.enable_thinking` was false: the
    prompt already closed the block) takes the whole output as content.
    """

    __slots__ = ("_state", "_held", "opened", "last_in_reasoning")

    def __init__(self, thinking: bool = True) -> None:
        self._state = _START if thinking else _CONTENT
        self._held = ""
        self.opened = False  # the output opened a reasoning block
        # whether the text of the last feed was (partly) reasoning: its tokens count as
        # reasoning tokens
        self.last_in_reasoning = False

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text`, after what came before, makes certain."""
        buf = self._held + text
        self._held = ""
        reasoning = content = ""
        self.last_in_reasoning = self._state == _THINK
        if self._state == _START:
            if buf.startswith(THINK_BEGIN):
                buf = buf[len(THINK_BEGIN):]
                self._state = _THINK
                self.opened = self.last_in_reasoning = True
            elif THINK_BEGIN.startswith(buf):
                self._held = buf  # could still become "<think>"
                return "", ""
            else:
                self._state = _CONTENT
        if self._state == _THINK:
            end = buf.find(THINK_END)
            if end < 0:
                keep = partial_tag(buf, THINK_END)
                self._held = buf[len(buf) - keep:]
                return buf[:len(buf) - keep], ""
            reasoning, buf = buf[:end], buf[end + len(THINK_END):]
            self._state = _CONTENT
        content = buf
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held at the end of the output."""
        held, self._held = self._held, ""
        if self._state == _THINK:
            return held, ""
        return "", held

    @classmethod
    def parse(cls, text: str, thinking: bool = True) -> tuple[str | None, str]:
        """A whole output as (reasoning or None when it opened no block, content)."""
        parser = cls(thinking)
        r1, c1 = parser.feed(text)
        r2, c2 = parser.finish()
        return (r1 + r2 if parser.opened else None), c1 + c2


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}
