"""/v1/responses through the official `openai` client, unmodified: plain and streamed answers,
Qwen3's thinking on and off, a tool call, a JSON-schema answer, and bad input as OpenAI-style
400s. The scripted fake engine (fake_engine.py) gives exact texts; the tool call and the JSON
schema run on the real qwen3-tiny engine in this process, where xgrammar enforces them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fake_engine import MODEL, FakeEngine
from pydantic import BaseModel, Field

from cluster.api.engine_client import LocalEngineClient
from cluster.api.openai_api import create_app


def _run(engine: Any, tokenizer: Any, call: Any, **app_kwargs: Any) -> Any:
    """`await call(client)` with an AsyncOpenAI client on a fresh app over `engine`."""
    app = create_app(LocalEngineClient(engine), tokenizer, **app_kwargs)

    async def go() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http,
                                        max_retries=0)
            return await call(client)

    return asyncio.run(go())


class ScriptedEngine(FakeEngine):
    """The fake engine saying a given text, then its end-of-turn token (finish "stop")."""

    def say(self, text: str) -> int:
        """Script `text`; its length in tokens."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.script = [*ids, self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        return len(ids)

    def generate(self, prompt_token_ids: list[int], sampling_params: Any, request_id: str,
                 cache_salt: str | None = None, lora_request: Any = None) -> Any:
        sampling_params.stop_token_ids = [self.script[-1]]
        return super().generate(prompt_token_ids, sampling_params, request_id, cache_salt)


@pytest.fixture
def engine(tokenizer: Any) -> ScriptedEngine:
    return ScriptedEngine(tokenizer)


def _script(engine: ScriptedEngine, tokenizer: Any, text: str) -> int:
    return engine.say(text)


def test_plain_answer_with_instructions(engine: ScriptedEngine, tokenizer: Any) -> None:
    n = _script(engine, tokenizer, "Hello there, friend.")

    resp = _run(engine, tokenizer, lambda c: c.responses.create(
        model=MODEL, input="Say hi", instructions="Be brief.", max_output_tokens=n + 1,
        temperature=0.5, top_p=0.9))
    assert resp.status == "completed" and resp.object == "response"
    assert resp.output_text == "Hello there, friend."
    assert [item.type for item in resp.output] == ["message"]
    assert resp.usage.output_tokens == n + 1  # the end-of-turn token counts
    prompt, params, _, _ = engine.calls[-1]
    assert resp.usage.input_tokens == len(prompt)
    rendered = tokenizer.decode(prompt)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hi")
    assert (params.max_tokens, params.temperature, params.top_p) == (n + 1, 0.5, 0.9)


def test_cut_off_answer_is_incomplete(engine: ScriptedEngine, tokenizer: Any) -> None:
    _script(engine, tokenizer, "one two three four five six")
    resp = _run(engine, tokenizer, lambda c: c.responses.create(
        model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Count"}]}],
        max_output_tokens=2))
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "one two"


def test_streamed_answer_events(engine: ScriptedEngine, tokenizer: Any) -> None:
    n = _script(engine, tokenizer, "Streams are fun.")

    async def call(client: openai.AsyncOpenAI) -> tuple[list[Any], Any]:
        async with client.responses.stream(model=MODEL, input="Go",
                                           max_output_tokens=n + 1) as stream:
            events = [e async for e in stream]
            return events, await stream.get_final_response()

    events, final = _run(engine, tokenizer, call)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.output_text.done", "response.content_part.done",
                 "response.output_item.done"):
        assert kinds.count(kind) == 1, kinds
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == n and "".join(deltas) == "Streams are fun."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == "Streams are fun." and final.usage.output_tokens == n + 1


@pytest.mark.parametrize("thinking", [True, False])
def test_thinking_on_and_off(engine: ScriptedEngine, tokenizer: Any, thinking: bool) -> None:
    text = "<think>plan it</think>The answer."
    n = _script(engine, tokenizer, text)
    reasoning = None if thinking else {"effort": "none"}

    async def call(client: openai.AsyncOpenAI) -> Any:
        async with client.responses.stream(model=MODEL, input="Why?", max_output_tokens=n + 1,
                                           reasoning=reasoning) as stream:
            return [e async for e in stream], await stream.get_final_response()

    events, resp = _run(engine, tokenizer, call, reasoning_parser="qwen3")
    rendered = tokenizer.decode(engine.calls[-1][0])
    assert rendered.endswith("assistant\n" if thinking else "<think>\n\n</think>\n\n")
    if thinking:
        assert [item.type for item in resp.output] == ["reasoning", "message"]
        assert resp.output[0].content[0].text == "plan it"
        assert resp.output_text == "The answer."
        assert resp.usage.output_tokens_details.reasoning_tokens > 0
        assert "".join(e.delta for e in events
                       if e.type == "response.reasoning_text.delta") == "plan it"
    else:  # the prompt closed the block: the whole output is the answer
        assert [item.type for item in resp.output] == ["message"]
        assert resp.output_text == text


def test_function_call_output_items_are_rendered_as_tool_messages(engine: ScriptedEngine,
                                                                  tokenizer: Any) -> None:
    n = _script(engine, tokenizer, "It is sunny.")
    engine.max_model_len = 512  # the tools' description makes a long prompt
    tool = {"type": "function", "name": "weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    resp = _run(engine, tokenizer, lambda c: c.responses.create(
        model=MODEL, max_output_tokens=n + 1, tools=[tool], input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]),
        tool_call_parser="hermes")
    rendered = tokenizer.decode(engine.calls[-1][0])
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in rendered
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    assert resp.output_text == "It is sunny."


@pytest.mark.parametrize("body, param, needle", [
    ({"input": "hi", "frobnicate": 1}, "frobnicate", "unknown field 'frobnicate'"),
    ({"input": 7}, "input", "input"),
    ({"input": "hi", "max_output_tokens": "ten"}, "max_output_tokens", "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, "temperature", "temperature"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id",
     "keeps no responses"),
    ({"input": "hi", "store": True}, "store", "keeps no responses"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "input_image"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}]}, "tools",
     "tool_call_parser"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text",
     "needs a schema"),
])
def test_bad_input_is_an_openai_400(engine: ScriptedEngine, tokenizer: Any, body: dict, param: str,
                                    needle: str) -> None:
    async def call(client: openai.AsyncOpenAI) -> Any:
        with pytest.raises(openai.BadRequestError) as info:
            await client.post("/responses", body={"model": MODEL, **body}, cast_to=httpx.Response)
        return info.value

    err = _run(engine, tokenizer, call)
    assert err.status_code == 400
    assert err.body["type"] == "invalid_request_error" and err.body["param"] == param
    assert needle in err.body["message"]
    assert engine.calls == []


def test_models_root_is_where_the_tokenizer_lives(engine: ScriptedEngine, tokenizer: Any,
                                                  tiny_model_path: str) -> None:
    models = _run(engine, tokenizer, lambda c: c.models.list())
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].root == tiny_model_path


# --- the real engine: constraints enforced by xgrammar -----------------------------------


class Weather(BaseModel):
    city: str = Field(max_length=12)  # random weights: an unbounded string runs to the limit
    celsius: int = Field(ge=-50, le=50)


@pytest.fixture(scope="module")
def real_engine() -> Iterator[Any]:
    from cluster.engine.async_llm_engine import AsyncLLMEngine
    from cluster.engine.config import EngineConfig

    # JSON without whitespace (the server's setting): random weights would otherwise spend
    # the token budget on it (tabs and newlines between the tokens) and get cut off
    engine = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=4,
                                         reasoning_parser="qwen3", tool_call_parser="hermes",
                                         disable_any_whitespace=True))
    yield engine
    engine.shutdown()


def test_json_schema_answer_parses(real_engine: Any) -> None:
    resp = _run(real_engine, real_engine.tokenizer, lambda c: c.responses.parse(
        model="qwen3-tiny", input="Weather in Paris as JSON", text_format=Weather,
        reasoning={"effort": "none"}, max_output_tokens=200, temperature=1.0,
        extra_body={"seed": 3}),
        reasoning_parser="qwen3", tool_call_parser="hermes")
    assert resp.status == "completed"
    assert isinstance(resp.output_parsed, Weather)
    assert Weather.model_validate_json(resp.output_text) == resp.output_parsed
    compact = json.dumps(json.loads(resp.output_text), separators=(",", ":"), ensure_ascii=False)
    assert resp.output_text == compact


def test_forced_tool_call_streams_a_function_call_item(real_engine: Any) -> None:
    tool = {"type": "function", "name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
                                                  "maximum": 23}},
        "required": ["hour"], "additionalProperties": False}}

    async def call(client: openai.AsyncOpenAI) -> Any:
        async with client.responses.stream(
                model="qwen3-tiny", input="Alarm at 7", tools=[tool],
                tool_choice={"type": "function", "name": "set_alarm"},
                reasoning={"effort": "none"}, max_output_tokens=200, temperature=1.0,
                extra_body={"seed": 7}) as stream:
            return [e async for e in stream], await stream.get_final_response()

    events, resp = _run(real_engine, real_engine.tokenizer, call, reasoning_parser="qwen3",
                        tool_call_parser="hermes")
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "set_alarm"
    assert 0 <= json.loads(calls[0].arguments)["hour"] <= 23
    assert calls[0].call_id and calls[0].status == "completed"
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in args] == [calls[0].arguments]


def test_disable_any_whitespace_is_a_checked_server_setting() -> None:
    from cluster.engine.config import EngineConfig

    with pytest.raises(ValueError, match="disable_any_whitespace must be true or false"):
        EngineConfig(disable_any_whitespace="yes")
    assert EngineConfig.from_dict({"disable_any_whitespace": True}).disable_any_whitespace
