"""The HTTP surface of structured outputs, reasoning and tools, over a scripted engine.

`TextEngine` answers every request with one fixed model text, a token per delta (the real
engine over HTTP is in test_structured_engine.py). What is checked here: the request fields
become the right SamplingParams or a 400 with OpenAI's error body, tools reach the chat
template, and the parsers turn the model text into reasoning_content / content / tool_calls,
whole and streamed, read by the openai client.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from cluster.api.engine_client import LocalEngineClient
from cluster.api.openai_api import create_app
from cluster.engine.config import EngineConfig
from scheduler import CompletionOutput, RequestOutput, SamplingParams

MODEL = "text-engine"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
THOUGHT_AND_CALLS = ('<think>\nThe user wants weather and time.\n</think>\n\nChecking.\n'
                     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                     '</tool_call>')


class TextEngine:
    """Answers with `text`, one token per delta, then stops (finish_reason "stop")."""

    model_name = MODEL
    max_model_len = 4096
    config = EngineConfig(max_num_seqs=8)
    default_sampling: dict = {}  # the model recommends no sampling defaults
    pooling = None  # a generating model (a pooling runner's would be a PoolingInfo)

    def __init__(self, tokenizer: Any, text: str = "Hello.") -> None:
        self.tokenizer = tokenizer
        self.text = text
        self.calls: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str, cache_salt: str | None = None,
                       lora_request: Any = None):
        self.calls.append((list(prompt_token_ids), sampling_params))
        ids = self.tokenizer.encode(self.text, add_special_tokens=False)
        for i, tok in enumerate(ids):
            await asyncio.sleep(0)
            last = i == len(ids) - 1
            outs = [CompletionOutput(j, [tok], self.tokenizer.decode([tok]),
                                     "stop" if last else None, None, None)
                    for j in range(sampling_params.n)]
            yield RequestOutput(request_id, prompt_token_ids, outs, last, 0)

    def check_health(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def post(engine: TextEngine, body: dict, path: str = "/v1/chat/completions",
         **app_kwargs: Any) -> httpx.Response:
    app = create_app(LocalEngineClient(engine), engine.tokenizer, **app_kwargs)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            return await client.post(path, content=json.dumps(body))

    return asyncio.run(go())


def chat(**fields: Any) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50, **fields}


def client_for(engine: TextEngine, **app_kwargs: Any) -> tuple[openai.AsyncOpenAI, Any]:
    app = create_app(LocalEngineClient(engine), engine.tokenizer, **app_kwargs)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http), http


# ----- constraints -------------------------------------------------------------------------


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, kind, value", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json", SCHEMA),
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"guided_json": SCHEMA}, "json", SCHEMA),
    ({"guided_json": json.dumps(SCHEMA)}, "json", SCHEMA),
    ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ({"structured_outputs": {"regex": r"\d+", "disable_any_whitespace": True}}, "regex", r"\d+"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_every_constraint_spelling_reaches_the_engine(tokenizer: Any, fields: dict, kind: str,
                                                      value: Any, path: str) -> None:
    engine = TextEngine(tokenizer)
    body = chat(**fields) if path.endswith("chat/completions") else {"prompt": "Hi", **fields}
    resp = post(engine, body, path)
    assert resp.status_code == 200, resp.text
    spec = engine.calls[0][1].structured_outputs
    assert spec.kind == kind and getattr(spec, kind) == value and not spec.reasoning
    assert spec.disable_any_whitespace == ("structured_outputs" in fields)


def test_text_response_format_constrains_nothing(tokenizer: Any) -> None:
    engine = TextEngine(tokenizer)
    assert post(engine, chat(response_format={"type": "text"})).status_code == 200
    assert engine.calls[0][1].structured_outputs is None


def test_constraint_opens_with_thinking_only_when_the_reasoning_parser_is_on(
        tokenizer: Any) -> None:
    engine = TextEngine(tokenizer)
    post(engine, chat(guided_regex="a"), reasoning_parser="qwen3")
    post(engine, chat(guided_regex="a", chat_template_kwargs={"enable_thinking": False}),
         reasoning_parser="qwen3")
    post(engine, chat(guided_regex="a"))
    assert [sp.structured_outputs.reasoning for _, sp in engine.calls] == [True, False, False]


@pytest.mark.parametrize("fields, param, needle", [
    ({"temprature": 0.5}, "temprature", "unknown field 'temprature'"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "unknown field 'reasoning_effort'"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     "guided_regex and guided_choice both constrain the output"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "response_format and structured_outputs both constrain"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs",
     "structured_outputs: unknown field 'whitespace_pattern'; valid ones: ['json', "),
    ({"structured_outputs": {}}, "structured_outputs", "structured_outputs: structured_outputs "
                                                       "must set exactly one of"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs",
     "structured_outputs.regex must be a non-empty string; got 5"),
    ({"guided_choice": []}, "guided_choice", "choice must be a non-empty list"),
    ({"guided_json": "{oops"}, "guided_json", "guided_json: structured_outputs.json is not "
                                              "valid JSON"),
])
def test_bad_constraint_requests_are_400(tokenizer: Any, fields: dict, param: str,
                                         needle: str) -> None:
    engine = TextEngine(tokenizer)
    resp = post(engine, chat(**fields))
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert needle in err["message"], err
    assert (err["type"], err["param"]) == ("invalid_request_error", param)
    assert engine.calls == []


def test_harmless_unknown_fields_are_ignored(tokenizer: Any) -> None:
    engine = TextEngine(tokenizer)
    resp = post(engine, chat(user="u1", metadata={"k": "v"}, store=False,
                             service_tier="auto", prompt_cache_key="p"))
    assert resp.status_code == 200, resp.text


# ----- reasoning ---------------------------------------------------------------------------


def test_reasoning_content_split_whole_with_reasoning_tokens(tokenizer: Any) -> None:
    engine = TextEngine(tokenizer, "<think>\nTwo plus two.\n</think>\n\nFour.")
    body = post(engine, chat(n=2), reasoning_parser="qwen3").json()
    for choice in body["choices"]:
        assert choice["message"] == {"role": "assistant", "content": "\n\nFour.",
                                     "reasoning_content": "\nTwo plus two.\n"}
        assert choice["finish_reason"] == "stop"
    think = tokenizer.encode("<think>\nTwo plus two.\n</think>", add_special_tokens=False)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * len(think)}


def test_reasoning_content_streams_as_its_own_deltas(tokenizer: Any) -> None:
    engine = TextEngine(tokenizer, "<think>\nTwo plus two.\n</think>\n\nFour.")

    async def go() -> tuple[str, str, dict]:
        client, http = client_for(engine, reasoning_parser="qwen3")
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
            stream_options={"include_usage": True})
        reasoning = content = ""
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens_details.reasoning_tokens
            for c in chunk.choices:
                reasoning += getattr(c.delta, "reasoning_content", None) or ""
                content += c.delta.content or ""
        await http.aclose()
        return reasoning, content, usage

    reasoning, content, usage = asyncio.run(go())
    assert (reasoning, content) == ("\nTwo plus two.\n", "\n\nFour.")
    assert usage == len(tokenizer.encode("<think>\nTwo plus two.\n</think>",
                                         add_special_tokens=False))


def test_parser_off_leaves_thinking_in_the_content(tokenizer: Any) -> None:
    engine = TextEngine(tokenizer, "<think>\nhm\n</think>\n\nOK")
    message = post(engine, chat()).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>\nhm\n</think>\n\nOK"}


def test_enable_thinking_false_reaches_the_template_and_all_is_content(tokenizer: Any) -> None:
    engine = TextEngine(tokenizer, "Four.")
    body = post(engine, chat(chat_template_kwargs={"enable_thinking": False}),
                reasoning_parser="qwen3").json()
    assert tokenizer.decode(engine.calls[0][0]).endswith("<think>\n\n</think>\n\n")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Four.",
                                             "reasoning_content": None}
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


# ----- tools -------------------------------------------------------------------------------


def test_tools_reach_the_template_and_calls_come_back_whole(tokenizer: Any) -> None:
    engine = TextEngine(tokenizer, THOUGHT_AND_CALLS)
    body = post(engine, chat(tools=[WEATHER, TIME]), reasoning_parser="qwen3",
                tool_call_parser="hermes").json()
    prompt = tokenizer.decode(engine.calls[0][0])
    assert "# Tools" in prompt and '"name": "get_weather"' in prompt
    assert engine.calls[0][1].structured_outputs is None  # auto: the model may answer in text
    choice = body["choices"][0]
    message = choice["message"]
    assert message["content"] == "\n\nChecking."  # as vLLM: what follows </think>, verbatim
    assert message["reasoning_content"] == "\nThe user wants weather and time.\n"
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [("function", "get_weather", {"city": "Paris"}),
                                ("function", "get_time", {})]
    assert len({c["id"] for c in calls}) == 2
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert choice["finish_reason"] == "tool_calls"


def test_streamed_tool_calls_are_reassembled_by_the_openai_client(tokenizer: Any) -> None:
    engine = TextEngine(tokenizer, THOUGHT_AND_CALLS)

    async def go() -> Any:
        client, http = client_for(engine, reasoning_parser="qwen3", tool_call_parser="hermes")
        async with client.chat.completions.stream(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                tools=[WEATHER, TIME]) as stream:
            final = await stream.get_final_completion()
        await http.aclose()
        return final

    final = asyncio.run(go())
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "\n\nChecking."
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                   ("get_time", {})]


def test_malformed_tool_call_stays_content(tokenizer: Any) -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {city}}\n</tool_call>'
    engine = TextEngine(tokenizer, text)
    choice = post(engine, chat(tools=[WEATHER]), tool_call_parser="hermes").json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("tool_choice, parallel", [
    ("required", True), ({"type": "function", "function": {"name": "get_time"}}, True),
    ("auto", False)])
def test_forcing_tool_choices_constrain_the_output(tokenizer: Any, tool_choice: Any,
                                                   parallel: bool) -> None:
    engine = TextEngine(tokenizer, '<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                                   '</tool_call>')
    body = post(engine, chat(tools=[WEATHER, TIME], tool_choice=tool_choice,
                             parallel_tool_calls=parallel), tool_call_parser="hermes").json()
    spec = engine.calls[0][1].structured_outputs
    assert spec.kind == "structural_tag" and "get_time" in spec.structural_tag
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"


def test_tool_choice_none_hides_the_tools_and_parses_nothing(tokenizer: Any) -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    engine = TextEngine(tokenizer, text)
    body = post(engine, chat(tools=[TIME], tool_choice="none"), tool_call_parser="hermes").json()
    assert "# Tools" not in tokenizer.decode(engine.calls[0][0])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}


def test_tool_results_round_trip_through_the_template(tokenizer: Any) -> None:
    engine = TextEngine(tokenizer)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"}]
    resp = post(engine, {"messages": messages, "tools": [WEATHER], "max_tokens": 5},
                tool_call_parser="hermes")
    assert resp.status_code == 200, resp.text
    prompt = tokenizer.decode(engine.calls[0][0])
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            in prompt)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


@pytest.mark.parametrize("fields, parser, param, needle", [
    ({"tools": [WEATHER]}, None, "tools", "tools need the server's tool_call_parser setting"),
    ({"tool_choice": "required"}, "hermes", "tool_choice", "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "hermes", "tool_choice", "tool_choice names the function 'nope', which is not in tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "hermes",
     "tool_choice", "guided_regex and tool_choice both constrain the output"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "x": {"not": {"type": "string"}}}}}}], "tool_choice": "required"}, "hermes",
     "tools", "uses not at $.properties.x"),
    ({"chat_template_kwargs": {"tools": []}}, "hermes", "chat_template_kwargs",
     "may not set ['tools']"),
])
def test_bad_tool_requests_are_400(tokenizer: Any, fields: dict, parser: str | None,
                                   param: str, needle: str) -> None:
    engine = TextEngine(tokenizer)
    resp = post(engine, chat(**fields), tool_call_parser=parser)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert needle in err["message"], err
    assert err["param"] == param
    assert engine.calls == []


def test_tool_result_answering_no_call_is_400(tokenizer: Any) -> None:
    engine = TextEngine(tokenizer)
    messages = [{"role": "user", "content": "Hi"},
                {"role": "tool", "tool_call_id": "call-9", "content": "x"}]
    resp = post(engine, {"messages": messages, "tools": [WEATHER]}, tool_call_parser="hermes")
    assert resp.status_code == 400
    assert "tool_call_id 'call-9' answers no earlier assistant tool call" in (
        resp.json()["error"]["message"])
