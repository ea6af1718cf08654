"""Structured outputs through the real engine on qwen3-tiny (random weights: only the
constraint makes an output valid), offline, streamed, and over the HTTP app.

Every output of every constrained request must satisfy its constraint, at temperature 1.0
with n = 3, with async scheduling on and off, and with a cache so small that sequences are
preempted (swap and recompute) mid-output: the matchers must follow their sequences.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from cluster import LLM, SamplingParams, StructuredOutputsParams
from cluster.api.engine_client import LocalEngineClient
from cluster.api.openai_api import create_app
from cluster.engine.async_llm_engine import AsyncLLMEngine
from cluster.engine.config import EngineConfig

OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS: list[dict[str, Any]] = [
    {**OBJ, "properties": {"ok": {"type": "boolean"},
                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                           "color": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "n", "color"]},
    {**OBJ, "properties": {"user": {**OBJ, "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "admin": {"type": "boolean"}}, "required": ["id", "admin"]}}, "required": ["user"]},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4},
    {"type": "array", "maxItems": 3, "items": {
        **OBJ, "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x"]}},
    {**OBJ, "properties": {"t": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
     "required": ["t"]},
    {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
    {**OBJ, "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,3}$"}},
     "required": ["code"]},
    {**OBJ, "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "null"}]},
    {"$defs": {"pt": {**OBJ, "properties": {"x": {"type": "integer", "minimum": 0,
                                                   "maximum": 3}},
                      "required": ["x"]}},
     **OBJ, "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
     "required": ["a", "b"]},
    {**OBJ, "properties": {"v": {"const": "fixed"}, "w": {"const": 3}}, "required": ["v", "w"]},
    {"enum": [1, "two", None, True, {"k": [1]}]},
    {**OBJ, "properties": {"req": {"type": "boolean"}, "opt": {"type": "null"}},
     "required": ["req"]},
    {**OBJ, "properties": {"l1": {**OBJ, "properties": {"l2": {
        "type": "array", "maxItems": 2, "items": {**OBJ, "properties": {
            "l3": {"enum": [True, False]}}, "required": ["l3"]}}}, "required": ["l2"]}},
     "required": ["l1"]},
    {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
    {"type": "boolean"},
    {"oneOf": [{**OBJ, "properties": {"kind": {"const": "a"}}, "required": ["kind"]},
               {"type": "integer", "minimum": 100, "maximum": 200}]},
    {**OBJ, "properties": {"step": {"type": "integer", "multipleOf": 5, "minimum": 0,
                                    "maximum": 50}}, "required": ["step"]},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": ["x", "y"]}],
     "items": False, "minItems": 2},
    {**OBJ, "properties": {"tag": {"type": "string", "maxLength": 3}}, "required": ["tag"]},
]
REGEX = r"(yes|no)-[0-9]{2,4}"
CHOICES = ["alpha", "beta", "gamma delta"]


def _requests() -> tuple[list[str], list[SamplingParams], list[Any]]:
    """One request per schema (every third with bounded whitespace, the rest compact), a
    regex and a choice; n = 3 at temperature 1.0, seeded."""
    specs = [StructuredOutputsParams(json=s, disable_any_whitespace=i % 3 != 0)
             for i, s in enumerate(SCHEMAS)]
    specs += [StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=CHOICES)]
    checks = [*SCHEMAS, REGEX, CHOICES]
    prompts = [f"Request {i}: answer in the format asked." for i in range(len(specs))]
    params = [SamplingParams(temperature=1.0, n=3, seed=i, max_tokens=200, structured_outputs=s)
              for i, s in enumerate(specs)]
    return prompts, params, checks


def check(text: str, expected: Any) -> None:
    """The output satisfies its constraint: a schema, a regex or a list of choices."""
    if isinstance(expected, dict):
        jsonschema.validate(json.loads(text), expected)
    elif isinstance(expected, str):
        assert re.fullmatch(expected, text), text
    else:
        assert text in expected, text


# Async scheduling on and off; a cache of 24 blocks for 66 sequences (swap and recompute).
ENGINES = [
    ("sync", {"async_scheduling": False}),
    ("async", {"async_scheduling": True}),
    ("async-recompute", {"async_scheduling": True, "num_gpu_blocks_override": 24,
                         "preemption_mode": "recompute"}),
    ("sync-swap", {"async_scheduling": False, "num_gpu_blocks_override": 24,
                   "preemption_mode": "swap", "swap_space": 0.05}),
]


@pytest.fixture(scope="module")
def constrained_runs() -> dict[str, list[list[tuple[list[int], str, str]]]]:
    prompts, params, _ = _requests()
    runs = {}
    for name, kwargs in ENGINES:
        with LLM("qwen3-tiny", max_num_seqs=64, max_num_batched_tokens=512, **kwargs) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[name] = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs]
                          for o in outs]
            stats = llm.engine.scheduler.stats()
            preempted = stats.preemptions_swap + stats.preemptions_recompute
            assert (preempted > 0) == ("num_gpu_blocks_override" in kwargs), name
            assert not llm.engine.structured.active and not llm.engine.structured._by_seq
    return runs


@pytest.mark.parametrize("name", [name for name, _ in ENGINES])
def test_every_constrained_output_is_valid(constrained_runs: dict, name: str) -> None:
    _, _, checks = _requests()
    texts = set()
    for outputs, expected in zip(constrained_runs[name], checks):
        for _, text, reason in outputs:
            assert reason == "stop", (text, expected)
            check(text, expected)
            texts.add(text)
    assert len(texts) > 40  # of 66: the samples are not one output by construction


def test_constrained_sampling_ignores_async_scheduling_and_preemption(
        constrained_runs: dict) -> None:
    """A seeded sample's tokens depend on its own history only: the same bitmasks in every
    mode means the matchers followed each sequence through preemption and async steps."""
    base = constrained_runs["sync"]
    for name, run in constrained_runs.items():
        assert [[t for t, _, _ in req] for req in run] == [[t for t, _, _ in req]
                                                           for req in base], name


def test_constraints_hold_under_every_sampling_option() -> None:
    """The bitmask comes first: top-k/top-p/min-p, penalties, logprobs and stop strings all
    see only allowed tokens (a disallowed token's logprob is reported as -inf)."""
    schema = SCHEMAS[0]
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    options = [dict(top_k=5), dict(top_p=0.5), dict(min_p=0.2), dict(temperature=0.0),
               dict(repetition_penalty=1.8, presence_penalty=1.5, frequency_penalty=1.0),
               dict(logprobs=5, seed=1), dict(temperature=1.7, top_k=40, top_p=0.9, min_p=0.01)]
    params = [SamplingParams(**{"temperature": 1.0, "max_tokens": 120, **o},
                             structured_outputs=spec) for o in options]
    with LLM("qwen3-tiny", max_num_seqs=16) as llm:
        outs = llm.generate([f"Option {i}" for i in range(len(options))], params,
                            use_tqdm=False)
        stopped = llm.generate(["Stop"], SamplingParams(
            temperature=1.0, max_tokens=120, stop=['"n"'], structured_outputs=spec),
            use_tqdm=False)[0].outputs[0]
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
    lps = outs[5].outputs[0].logprobs
    assert len(lps) == len(outs[5].outputs[0].token_ids)
    assert all(lp[t] > float("-inf") for lp, t in zip(lps, outs[5].outputs[0].token_ids))
    # A stop string still ends a constrained output (cut before it, as always).
    assert stopped.finish_reason == "stop" and stopped.text.startswith('{"ok":')
    assert '"n"' not in stopped.text


def test_ignore_eos_and_min_tokens_only_repeat_the_stop_token() -> None:
    """After the grammar ends, only EOS may follow; its text is empty."""
    with LLM("qwen3-tiny", max_num_seqs=4) as llm:
        eos = llm.engine.model_config.eos_token_ids
        spec = StructuredOutputsParams(choice=["yes", "no"])
        outs = llm.generate(["Hi", "Ho"], [
            SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, structured_outputs=spec),
            SamplingParams(temperature=1.0, max_tokens=8, min_tokens=5, seed=3,
                           structured_outputs=spec)], use_tqdm=False)
    for out, reason, length in zip(outs, ("length", "stop"), (6, 6)):
        c = out.outputs[0]
        assert c.text in ("yes", "no") and c.finish_reason == reason
        end = next(i for i, t in enumerate(c.token_ids) if t in eos)
        assert llm.get_tokenizer().decode(c.token_ids[:end]) == c.text
        assert set(c.token_ids[end:]) <= set(eos) and len(c.token_ids) == length


def test_bad_constraint_fails_the_call_before_anything_runs() -> None:
    with LLM("qwen3-tiny", max_num_seqs=4) as llm:
        good = SamplingParams(max_tokens=4)
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b"))
        with pytest.raises(ValueError, match="regex constraint does not compile"):
            llm.generate(["x", "y"], [good, bad], use_tqdm=False)
        assert not llm.engine.has_unfinished()
        out = llm.chat([{"role": "user", "content": "Pick"}],
                       SamplingParams(structured_outputs=StructuredOutputsParams(
                           choice=["left", "right"])), use_tqdm=False)
        assert out[0].outputs[0].text in ("left", "right")


def test_streamed_constrained_outputs_are_valid_and_abort_releases_matchers() -> None:
    engine = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=64,
                                         async_scheduling=True))
    prompts, params, checks = _requests()
    picks = range(len(prompts))  # every schema, the regex and the choice, streamed at once

    async def stream(i: int) -> list[str]:
        texts = [""] * params[i].n
        async for out in engine.generate(engine.tokenizer.encode(prompts[i]), params[i], f"s{i}"):
            for c in out.outputs:
                texts[c.index] += c.text
        return texts

    async def abandon() -> None:
        sp = SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(
            json={"type": "array", "items": {"type": "integer"}}))
        gen = engine.generate([5, 6, 7], sp, "dropped")
        await gen.__anext__()
        await gen.aclose()

    async def run() -> list:
        return await asyncio.gather(abandon(), *(stream(i) for i in picks))

    try:
        got = asyncio.run(asyncio.wait_for(run(), timeout=300))
        for i, texts in zip(picks, got[1:]):
            for text in texts:
                check(text, checks[i])
        assert not engine.engine.structured.active and not engine.engine.structured._by_seq
    finally:
        engine.shutdown()


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(pattern="^[A-Z][a-z]{2,8}$")
    celsius: int = pydantic.Field(ge=-40, le=50)
    sunny: bool


@pytest.fixture(scope="module")
def http_engine() -> Any:
    engine = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=16,
                                         reasoning_parser="qwen3", tool_call_parser="hermes"))
    yield engine
    engine.shutdown()


def _client(engine: AsyncLLMEngine) -> tuple[openai.AsyncOpenAI, httpx.AsyncClient]:
    app = create_app(LocalEngineClient(engine), engine.tokenizer, reasoning_parser="qwen3",
                     tool_call_parser="hermes")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http), http


def test_openai_parse_with_a_pydantic_model_over_http(http_engine: AsyncLLMEngine) -> None:
    async def go() -> list[Any]:
        client, http = _client(http_engine)
        try:
            done = await client.chat.completions.parse(
                model="qwen3-tiny", messages=[{"role": "user", "content": "Weather?"}],
                response_format=Weather, temperature=1.0, n=3, max_tokens=300, seed=7,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            return done.choices
        finally:
            await http.aclose()

    choices = asyncio.run(go())
    assert len(choices) == 3
    for c in choices:
        assert c.finish_reason == "stop"
        assert isinstance(c.message.parsed, Weather)
        assert c.message.reasoning_content is None  # the parser is on; no thinking here


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "set_alarm"}}])
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_tool_call_streams_a_valid_call_over_http(http_engine: AsyncLLMEngine,
                                                         tool_choice: Any, parallel: bool) -> None:
    """A forced choice gets calls and nothing else, each valid: "required" one call, or with
    parallel_tool_calls one or more; a named function exactly one."""
    tool = {"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
                                                  "maximum": 23}},
        "required": ["hour"], "additionalProperties": False}}}
    other = {"type": "function", "function": {"name": "cancel_alarm", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}

    async def go() -> Any:
        client, http = _client(http_engine)
        try:
            async with client.chat.completions.stream(
                    model="qwen3-tiny", messages=[{"role": "user", "content": "Alarm at 7"}],
                    tools=[tool, other], tool_choice=tool_choice, parallel_tool_calls=parallel,
                    temperature=1.0, max_tokens=300, seed=7,
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}}) as stream:
                return await stream.get_final_completion()
        finally:
            await http.aclose()

    choice = asyncio.run(go()).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    calls = choice.message.tool_calls
    assert len(calls) >= 1 if parallel and tool_choice == "required" else len(calls) == 1
    for call in calls:
        spec = {"set_alarm": tool, "cancel_alarm": other}[call.function.name]
        if tool_choice != "required":
            assert call.function.name == "set_alarm"
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}},
     'json constraint does not compile: Unsupported type "frobnicate"'),
    ({"guided_regex": "(unclosed"}, "regex constraint does not compile"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice names the function 'g', which is not in tools"),
])
def test_bad_constraints_are_400_and_the_server_keeps_serving(http_engine: AsyncLLMEngine,
                                                              body: dict, needle: str) -> None:
    async def go() -> tuple[httpx.Response, httpx.Response]:
        app = create_app(LocalEngineClient(http_engine), http_engine.tokenizer,
                         reasoning_parser="qwen3", tool_call_parser="hermes")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as http:
            msgs = [{"role": "user", "content": "Hi"}]
            bad = await http.post("/v1/chat/completions",
                                  json={"messages": msgs, "max_tokens": 5, **body})
            good = await http.post("/v1/chat/completions",
                                   json={"messages": msgs, "max_tokens": 5,
                                         "guided_choice": ["fine"]})
            return bad, good

    bad, good = asyncio.run(go())
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert ".cc" not in err["message"]
    assert good.status_code == 200
    assert good.json()["choices"][0]["message"]["content"] == "fine"


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_constrained_outputs_are_valid_on_ray_tp2(ray_cluster: None,
                                                  async_scheduling: bool) -> None:
    """The bitmask reaches rank 0 of a Ray TP group on its second thread (compiled graph,
    lagged with async scheduling) while the ranks run the forward pass."""
    prompts, params, checks = _requests()
    picks = [0, 2, 6, 9, 13, 17, 20, 21]
    with LLM("qwen3-tiny", tensor_parallel_size=2, worker_num_cpus=0.5, max_num_seqs=32,
             max_num_batched_tokens=256, async_scheduling=async_scheduling) as llm:
        outs = llm.generate([prompts[i] for i in picks], [params[i] for i in picks],
                            use_tqdm=False)
    for out, i in zip(outs, picks):
        for c in out.outputs:
            assert c.finish_reason == "stop"
            check(c.text, checks[i])


@pytest.mark.gpu
def test_constrained_outputs_are_valid_on_cuda_with_async_scheduling() -> None:
    """On CUDA the bitmask is filled while the GPU runs the forward pass of its step, and
    applied on the device (scheduling ahead is the default there)."""
    prompts, params, checks = _requests()
    with LLM("qwen3-tiny", device="cuda", dtype="float32", max_num_seqs=64,
             num_gpu_blocks_override=1024, swap_space=0.0625) as llm:  # (32 MiB: a shared GPU)
        assert llm.engine.async_scheduling
        outs = llm.generate(prompts, params, use_tqdm=False)
    for out, expected in zip(outs, checks):
        for c in out.outputs:
            assert c.finish_reason == "stop"
            check(c.text, expected)
