"""The OpenAI HTTP layer's responses over a deterministic fake engine (fake_engine.py): models,
completions and chat, streamed and whole, logprobs, every sampling field, an early-closed
stream, and the replica-to-ingress packing of outputs.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import numpy as np
import openai
from fake_engine import MODEL, FakeEngine, fetch, sse_events
from starlette.requests import Request

from cluster.api.engine_client import LocalEngineClient
from cluster.api.openai_api import OpenAIServing, create_app
from scheduler import CompletionOutput, Logprob, RequestOutput, SamplingParams


def test_models_lists_the_served_model(engine: FakeEngine, tokenizer: Any) -> None:
    resp = fetch(engine, tokenizer, "GET", "/v1/models")
    assert resp.status_code == 200
    data = resp.json()["data"]
    assert [(m["id"], m["object"], m["max_model_len"]) for m in data] == [(MODEL, "model", 64)]


def test_completion_returns_exact_text_per_choice_and_usage(engine: FakeEngine,
                                                            tokenizer: Any) -> None:
    resp = fetch(engine, tokenizer, "POST", "/v1/completions",
                 {"model": MODEL, "prompt": "Hello there", "max_tokens": 3, "n": 2})
    assert resp.status_code == 200
    body = resp.json()
    s = engine.script
    assert [c["text"] for c in body["choices"]] == [tokenizer.decode(s[0:3]),
                                                    tokenizer.decode(s[1:4])]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    prompt, sp, _, _ = engine.calls[0]
    assert prompt == tokenizer.encode("Hello there", add_special_tokens=False)
    assert (sp.n, sp.max_tokens) == (2, 3)


def test_completion_stream_sends_deltas_usage_and_done(engine: FakeEngine,
                                                       tokenizer: Any) -> None:
    resp = fetch(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": [5, 6, 7], "max_tokens": 3, "stream": True,
                  "stream_options": {"include_usage": True}})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp)
    deltas = [e["choices"][0] for e in events[:-1]]
    assert [d["text"] for d in deltas] == [tokenizer.decode([t]) for t in engine.script[:3]]
    assert [d["finish_reason"] for d in deltas] == [None, None, "length"]
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                   "prompt_tokens_details": {"cached_tokens": 3}}


def test_completion_batch_prompts_get_indices_prompt_major(engine: FakeEngine,
                                                           tokenizer: Any) -> None:
    resp = fetch(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 2, "n": 2})
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    s = engine.script
    assert [c["text"] for c in body["choices"]] == [tokenizer.decode(s[0:2]),
                                                    tokenizer.decode(s[1:3])] * 2
    assert sorted(c[0] for c in engine.calls) == [[1, 2], [3, 4, 5]]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 8


def test_completion_echo_prepends_prompt(engine: FakeEngine, tokenizer: Any) -> None:
    resp = fetch(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": "Hi", "max_tokens": 1, "echo": True})
    assert resp.json()["choices"][0]["text"] == "Hi" + tokenizer.decode(engine.script[:1])


def test_echo_with_logprobs_asks_the_engine_for_prompt_logprobs(engine: FakeEngine,
                                                                tokenizer: Any) -> None:
    """echo + logprobs k: prompt_logprobs k (vLLM's own field wins); echo with max_tokens 0
    generates one token and answers with the prompt alone."""
    for extra, want in (({"echo": True, "logprobs": 2}, 2), ({"logprobs": 2}, None),
                        ({"echo": True}, None),
                        ({"echo": True, "logprobs": 1, "prompt_logprobs": 4}, 4)):
        resp = fetch(engine, tokenizer, "POST", "/v1/completions",
                     {"prompt": "Hi there", "max_tokens": 1, **extra})
        assert resp.status_code == 200, resp.text
        assert engine.calls[-1][1].prompt_logprobs == want
    resp = fetch(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": "Hi there", "max_tokens": 0, "echo": True})
    body = resp.json()
    assert engine.calls[-1][1].max_tokens == 1
    assert body["choices"][0]["text"] == "Hi there"
    assert body["usage"]["completion_tokens"] == 0


def test_completion_logprobs_rank_top_tokens_and_offsets(engine: FakeEngine,
                                                         tokenizer: Any) -> None:
    resp = fetch(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": "Hi", "max_tokens": 2, "logprobs": 2})
    lp = resp.json()["choices"][0]["logprobs"]
    s = engine.script
    dec = [tokenizer.decode([t]) for t in s[:4]]
    assert lp["tokens"] == dec[:2]
    assert lp["token_logprobs"] == [-0.25, -0.25]
    # Chosen (-0.25) outranks the fake's alternatives (-0.5, -1.0): top-2 = chosen + best alt.
    assert lp["top_logprobs"] == [{dec[0]: -0.25, dec[1]: -0.5}, {dec[1]: -0.25, dec[2]: -0.5}]
    assert lp["text_offset"] == [0, len(dec[0])]
    assert engine.calls[0][1].logprobs == 2


def test_chat_renders_qwen3_template_with_enable_thinking(engine: FakeEngine,
                                                          tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    resp = fetch(engine, tokenizer, "POST", "/v1/chat/completions",
                 {"model": MODEL, "messages": messages, "max_completion_tokens": 2,
                  "chat_template_kwargs": {"enable_thinking": False}})
    assert resp.status_code == 200
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert engine.calls[0][0] == tokenizer.encode(text, add_special_tokens=False)
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant",
                                             "content": tokenizer.decode(engine.script[:2])}
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_default_max_tokens_fills_the_context(engine: FakeEngine, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    resp = fetch(engine, tokenizer, "POST", "/v1/chat/completions", {"messages": messages})
    prompt_len = len(engine.calls[0][0])
    assert engine.calls[0][1].max_tokens == 64 - prompt_len
    assert resp.json()["usage"]["completion_tokens"] == 64 - prompt_len


def test_chat_stream_opens_with_role_and_ends_with_finish(engine: FakeEngine,
                                                          tokenizer: Any) -> None:
    resp = fetch(engine, tokenizer, "POST", "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                  "max_tokens": 2, "stream": True, "stop_token_ids": [engine.script[1]]})
    events = sse_events(resp)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    choices = [e["choices"][0] for e in events]
    assert [c["delta"] for c in choices] == [
        {"role": "assistant", "content": ""},
        {"content": tokenizer.decode(engine.script[:1])}, {}]
    assert [c["finish_reason"] for c in choices] == [None, None, "stop"]
    assert choices[-1]["stop_reason"] == engine.script[1]


def test_chat_logprobs_carry_top_logprobs(engine: FakeEngine, tokenizer: Any) -> None:
    resp = fetch(engine, tokenizer, "POST", "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                  "logprobs": True, "top_logprobs": 1})
    content = resp.json()["choices"][0]["logprobs"]["content"]
    tok = tokenizer.decode(engine.script[:1])
    assert content == [{"token": tok, "logprob": -0.25, "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": tok, "logprob": -0.25,
                                          "bytes": list(tok.encode())}]}]


def test_every_sampling_field_reaches_the_engine(engine: FakeEngine, tokenizer: Any) -> None:
    fetch(engine, tokenizer, "POST", "/v1/completions", {
        "prompt": "x", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "n": 1,
        "stop": ["\n"], "seed": 42, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
        "min_tokens": 2, "stop_token_ids": [7], "skip_special_tokens": False,
        "include_stop_str_in_output": True, "cache_salt": "tenant-a",
        "logit_bias": {"50256": -100, "7": 2.5}})
    _, sp, rid, salt = engine.calls[0]
    assert sp == SamplingParams(
        n=1, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=42, max_tokens=5,
        min_tokens=2, stop=["\n"], stop_token_ids=[7], ignore_eos=True, logprobs=None,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
        skip_special_tokens=False, include_stop_str_in_output=True,
        logit_bias={50256: -100.0, 7: 2.5})
    assert rid.startswith("cmpl-") and salt == "tenant-a"


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out(
        engine: FakeEngine, tokenizer: Any) -> None:
    """The engine's generation_config defaults (Qwen3's here) apply to the settings a request
    does not send, in both APIs; what it sends wins, temperature 0 (greedy) included."""
    engine.default_sampling = {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                               "repetition_penalty": 1.05}
    fetch(engine, tokenizer, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 5})
    fetch(engine, tokenizer, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
        "top_k": 5})
    fetch(engine, tokenizer, "POST", "/v1/completions", {
        "prompt": "x", "max_tokens": 5, "top_p": 1.0, "repetition_penalty": 1.0})
    got = [(sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty)
           for _, sp, _, _ in engine.calls]
    assert got == [(0.6, 0.95, 20, 1.05), (0.0, 0.95, 5, 1.05), (0.6, 1.0, 20, 1.0)]


def test_openai_client_parses_responses(engine: FakeEngine, tokenizer: Any) -> None:
    app = create_app(LocalEngineClient(engine), tokenizer)

    async def go() -> tuple[str, list[str]]:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http)
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        stream = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=3,
                                                 stream=True)
        pieces = [c.choices[0].text async for c in stream]
        await http.aclose()
        return chat.choices[0].message.content, pieces

    content, pieces = asyncio.run(go())
    assert content == tokenizer.decode(engine.script[:3])
    assert pieces == [tokenizer.decode([t]) for t in engine.script[:3]]


def _request(body: dict[str, Any]) -> Request:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)
        sent = True
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": [], "query_string": b""}, receive)


def test_closing_a_stream_early_aborts_the_request(engine: FakeEngine, tokenizer: Any) -> None:
    serving = OpenAIServing(LocalEngineClient(engine), tokenizer)

    async def go() -> list[str]:
        resp = await serving.completions(_request({"prompt": "x", "max_tokens": 10,
                                                   "stream": True}))
        it = resp.body_iterator
        got = [await anext(it), await anext(it)]
        await it.aclose()  # what Starlette does when the client disconnects
        return got

    got = asyncio.run(go())
    assert len(got) == 2
    assert engine.aborted == [engine.calls[0][2]]


def test_pack_output_round_trip_drops_only_the_prompt() -> None:
    from cluster.api.handle_client import pack_output, unpack_output

    out = RequestOutput("cmpl-1", [11, 12, 13], [
        CompletionOutput(0, [5, 6], "ab", None, None, None),
        CompletionOutput(1, [7], "c", "stop", 151645, [{7: -0.25, 9: -1.5}])],
        finished=False, num_cached_tokens=16)
    packed = pack_output(out)
    assert packed == (False, 16, ((0, [5, 6], "ab", None, None, None),
                                  (1, [7], "c", "stop", 151645, [{7: -0.25, 9: -1.5}])), None,
                      None, None)
    assert unpack_output("cmpl-1", [11, 12, 13], packed) == out
    # The first output of a request with prompt_logprobs carries them across.
    out.prompt_logprobs = [None, {12: Logprob(-1.5, 3, "b"), 7: Logprob(-0.5, 1, "c")},
                           {13: Logprob(-0.25, 1, "d")}]
    assert unpack_output("cmpl-1", [11, 12, 13], pack_output(out)) == out
    # A stream's first output names the replica that serves it (the X-Replica-Id header).
    first = unpack_output("cmpl-1", [11, 12, 13], pack_output(out, "replica-a"))
    assert first.replica_id == "replica-a" and first.outputs == out.outputs
    # A pooling request's last output carries its vector (RequestOutput.pooled).
    out.pooled = np.array([0.6, 0.8], dtype=np.float32)
    pooled = unpack_output("cmpl-1", [11, 12, 13], pack_output(out)).pooled
    assert pooled.dtype == np.float32 and pooled.tolist() == out.pooled.tolist()


def test_tokenize_counts_what_the_generation_routes_send_the_engine(engine: FakeEngine,
                                                                    tokenizer: Any) -> None:
    """vLLM's /tokenize: a prompt's ids, and a conversation's as /v1/chat/completions renders
    it (the same ids the engine is then given), with the context length."""
    resp = fetch(engine, tokenizer, "POST", "/tokenize",
                 {"model": MODEL, "prompt": "Hello there", "return_token_strs": True})
    assert resp.status_code == 200
    ids = tokenizer.encode("Hello there")
    assert resp.json() == {"count": len(ids), "max_model_len": 64, "tokens": ids,
                           "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = fetch(engine, tokenizer, "POST", "/tokenize", {"messages": messages}).json()
    fetch(engine, tokenizer, "POST", "/v1/chat/completions",
          {"messages": messages, "max_tokens": 2})
    assert chat["tokens"] == engine.calls[0][0] and chat["count"] == len(chat["tokens"])
    assert chat["token_strs"] is None
    # Longer than the context is an answer here, not an error: that is what one asks it for.
    long = fetch(engine, tokenizer, "POST", "/tokenize", {"prompt": "word " * 100}).json()
    assert long["count"] > long["max_model_len"]


def test_detokenize_is_tokenize_backwards_and_checks_the_ids(engine: FakeEngine,
                                                             tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello there, how are you?")
    resp = fetch(engine, tokenizer, "POST", "/detokenize", {"tokens": ids})
    assert resp.status_code == 200 and resp.json() == {"prompt": "Hello there, how are you?"}
    bad = fetch(engine, tokenizer, "POST", "/detokenize", {"tokens": [5, 10**7]})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "tokens"
    assert "outside the vocabulary" in bad.json()["error"]["message"]
    wrong_model = fetch(engine, tokenizer, "POST", "/tokenize", {"model": "gpt-4", "prompt": "x"})
    assert wrong_model.status_code == 404
    # A prompt that names messages inside its text is still a prompt.
    text = fetch(engine, tokenizer, "POST", "/tokenize", {"prompt": 'x"messages"'}).json()
    assert text["tokens"] == tokenizer.encode('x"messages"')
    assert engine.calls == []


def test_tokenizer_routes_need_the_api_key_when_one_is_set(engine: FakeEngine,
                                                           tokenizer: Any) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
        denied = fetch(engine, tokenizer, "POST", path, body, api_key="k")
        assert denied.status_code == 401
        allowed = fetch(engine, tokenizer, "POST", path, body, api_key="k",
                        headers={"Authorization": "Bearer k"})
        assert allowed.status_code == 200
