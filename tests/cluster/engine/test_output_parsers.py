"""The reasoning (qwen3) and tool-call (hermes) parsers on fixed model texts, whole and
streamed: fed in two pieces split at every point, and one character at a time, a text gives
exactly what it gives whole."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import pytest

from cluster.engine.reasoning import Qwen3ReasoningParser
from cluster.engine.tool_parsers import HermesToolParser


def pieces(text: str) -> Iterator[list[str]]:
    """Every way of cutting `text` in two, then one character at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


def stream_reasoning(chunks: list[str], thinking: bool = True) -> tuple[str | None, str, int]:
    parser = Qwen3ReasoningParser(thinking)
    reasoning = content = ""
    in_reasoning = 0
    for chunk in chunks:
        r, c = parser.feed(chunk)
        reasoning += r
        content += c
        in_reasoning += parser.last_in_reasoning
    r, c = parser.finish()
    return (reasoning + r if parser.opened else None), content + c, in_reasoning


REASONING_CASES = [
    # (model text, reasoning, content)
    ("<think>\nLet me think: 2 + 2.\n</think>\n\nThe answer is 4.",
     "\nLet me think: 2 + 2.\n", "\n\nThe answer is 4."),
    ("<think>\nStill thinking when max_tokens hit </thi", "\nStill thinking when max_tokens hit </thi",
     ""),
    ("The answer, without thinking. <think> is just text here", None,
     "The answer, without thinking. <think> is just text here"),
    ("<think>\n\n</think>\n\nHi", "\n\n", "\n\nHi"),
    ("<thinking about it", None, "<thinking about it"),
    ("<thi", None, "<thi"),
    ("", None, ""),
    ("<think>a</think>b</think>c", "a", "b</think>c"),
]


@pytest.mark.parametrize("text, reasoning, content", REASONING_CASES)
def test_qwen3_reasoning_split_whole_and_streamed(text: str, reasoning: str | None,
                                                  content: str) -> None:
    assert Qwen3ReasoningParser.parse(text) == (reasoning, content)
    for chunks in pieces(text):
        assert stream_reasoning(chunks)[:2] == (reasoning, content), chunks


def test_qwen3_thinking_off_takes_everything_as_content() -> None:
    text = "<think>\nno</think>\n\nyes"
    assert Qwen3ReasoningParser.parse(text, thinking=False) == (None, text)
    assert stream_reasoning([text[:3], text[3:]], thinking=False) == (None, text, 0)


def test_qwen3_counts_the_deltas_that_carry_reasoning() -> None:
    # token by token, as the engine streams: <think>, 3 reasoning tokens, </think>, 2 content
    tokens = ["<think>", "\nhm", "m", "\n", "</think>", "\n\n", "Yes"]
    assert stream_reasoning(tokens) == ("\nhmm\n", "\n\nYes", 5)


def ids() -> Iterator[str]:
    return (f"call-{i}" for i in itertools.count())


def stream_tools(chunks: list[str]) -> tuple[str, list[dict]]:
    parser = HermesToolParser(ids().__next__)
    content, calls = "", []
    for chunk in chunks:
        c, new = parser.feed(chunk)
        content += c
        calls += new
    c, new = parser.finish()
    return content + c, calls + new


def call(i: int, name: str, arguments: dict) -> dict:
    return {"id": f"call-{i}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


TOOL_CASES = [
    # (model text, content, calls)
    ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "München"}}'
     '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     "Let me check both.",
     [call(0, "get_weather", {"city": "München"}), call(1, "get_time", {"tz": "CET"})]),
    ('<tool_call>\n{"name": "f", "arguments": {bad json}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {bad json}\n</tool_call>', []),
    ('A\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>not json</tool_call>\nB',
     "A<tool_call>not json</tool_call>\nB", [call(0, "f", {})]),
    ('<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n',  # ended inside, JSON complete
     "", [call(0, "f", {"x": [1, 2]})]),
    ('Sure. <tool_call>\n{"name": "f", "argu',  # ended inside, JSON cut off
     'Sure. <tool_call>\n{"name": "f", "argu', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', []),
    ('<tool_call>{"name": "ping"}</tool_call>\n\n', "", [call(0, "ping", {})]),
    ("Plain answer, no calls. <tool_ is not a tag\n", "Plain answer, no calls. <tool_ is not a tag\n",
     []),
]


@pytest.mark.parametrize("text, content, calls", TOOL_CASES)
def test_hermes_tool_calls_whole_and_streamed(text: str, content: str, calls: list) -> None:
    assert HermesToolParser.parse(text, ids().__next__) == (content, calls)
    for chunks in pieces(text):
        assert stream_tools(chunks) == (content, calls), chunks
