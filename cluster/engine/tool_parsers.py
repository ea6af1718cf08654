"""Tool-call parsers: a model's tool calls, written in its own format, as OpenAI `tool_calls`.

`hermes` (vLLM's `--tool-call-parser hermes`, Qwen3's format): each call is a block
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A block whose JSON is an object
with a string `name` (and an object `arguments`, or none) is a call; any other block (bad
JSON, missing name) stays in the content verbatim, so nothing the model wrote is lost. The
content is the text outside the calls, less the whitespace that only separated it from them.
A last block the output ended inside (no `</tool_call>`) is a call if its JSON is complete.

A parser follows one choice's text as it streams: `feed(delta)` returns the content that is
certain so far and each call once its block is closed (a call is sent whole, in one delta,
which OpenAI clients reassemble like any other); `finish()` returns the rest. Feeding a text
whole or in any pieces gives the same content and calls.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from cluster.engine.reasoning import partial_tag
from scheduler.sampling_params import StructuredOutputsParams

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class HermesToolParser:
    """One choice's `<tool_call>` blocks (see the module docstring)."""

    __slots__ = ("_buf", "_in_call", "_gap", "_after_call", "_new_id", "num_calls")

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._buf = ""
        self._in_call = False
        self._gap = ""  # whitespace between the content and the open block
        self._after_call = False  # the last thing was a call: drop the whitespace after it
        self._new_id = new_id
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, calls) that `text`, after what came before, makes certain."""
        buf = self._buf + text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if self._in_call:
                end = buf.find(CALL_END)
                if end < 0:
                    break
                self._close(buf[:end], True, content, calls)
                buf = buf[end + len(CALL_END):]
                continue
            if self._after_call:
                buf = buf.lstrip()
                if not buf:
                    break
                self._after_call = False
            begin = buf.find(CALL_BEGIN)
            if begin < 0:
                # Hold what may belong to a block: a partial "<tool_call>" and the whitespace
                # before it.
                text = buf[:len(buf) - partial_tag(buf, CALL_BEGIN)]
                kept = text.rstrip()
                content.append(kept)
                buf = buf[len(kept):]
                break
            before = buf[:begin]
            kept = before.rstrip()
            content.append(kept)
            self._gap = before[len(kept):]
            self._in_call = True
            buf = buf[begin + len(CALL_BEGIN):]
        self._buf = buf
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content, calls) still held at the end of the output."""
        buf, self._buf = self._buf, ""
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        if self._in_call:
            self._close(buf, False, content, calls)
        elif not self._after_call:
            content.append(buf)
        return "".join(content), calls

    def _close(self, block: str, closed: bool, content: list[str],
               calls: list[dict[str, Any]]) -> None:
        self._in_call = False
        call = self._call(block)
        if call is None:
            content.append(self._gap + CALL_BEGIN + block + (CALL_END if closed else ""))
        else:
            calls.append(call)
            self._after_call = True
        self._gap = ""

    def _call(self, block: str) -> dict[str, Any] | None:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        self.num_calls += 1
        return {"id": self._new_id(), "type": "function",
                "function": {"name": obj["name"],
                             "arguments": json.dumps(arguments, ensure_ascii=False)}}

    @classmethod
    def parse(cls, text: str, new_id: Callable[[], str] = new_call_id
              ) -> tuple[str, list[dict[str, Any]]]:
        """A whole output as (content, calls)."""
        parser = cls(new_id)
        c1, calls1 = parser.feed(text)
        c2, calls2 = parser.finish()
        return c1 + c2, calls1 + calls2


def tool_call_constraint(tools: list[dict[str, Any]], tool_choice: Any,
                         parallel_tool_calls: bool) -> StructuredOutputsParams:
    """The constraint that makes Qwen3 answer with `<tool_call>` blocks as `tool_choice` asks
    ("required", {"type": "function", "function": {"name": ...}}, or "auto" with at most one
    call), their arguments valid against the tools' parameter schemas (xgrammar's qwen_3
    structural tag). "required" allows nothing but the calls, one per line (one only without
    parallel_tool_calls): xgrammar's own tag for it lets free text follow the first call; a
    named function gets exactly one call. ValueError for tools it cannot express."""
    import xgrammar as xgr

    from cluster.engine.grammar import MAX_JSON_WHITESPACE, check_schema

    for tool in tools:
        check_schema(tool["function"].get("parameters") or {})
    tag = xgr.get_model_structural_tag("qwen_3", tools=tools, tool_choice=tool_choice,
                                       reasoning="disabled",
                                       max_whitespace_cnt=MAX_JSON_WHITESPACE,
                                       parallel_tool_calls=parallel_tool_calls)
    spec = json.loads(tag.model_dump_json())
    if tool_choice == "required":  # (a named one is already exactly one tag)
        calls = spec["format"]
        spec["format"] = {"type": "tags_with_separator", "tags": calls["tags"], "separator": "\n",
                          "at_least_one": True, "stop_after_first": not parallel_tool_calls}
    return StructuredOutputsParams(structural_tag=json.dumps(spec))


TOOL_CALL_PARSERS = {"hermes": HermesToolParser}
