"""The OpenAI HTTP layer over a small deterministic fake engine (no Ray, no model).

The fake implements AsyncLLMEngine's async API: sample i of a request emits, at step t,
token SCRIPT[(i + t) % len(SCRIPT)] with a fixed logprob table, so every test can state
the exact text, tokens and logprobs it expects. The real engine over real HTTP is tested
in test_serve_http.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Any

import httpx
import openai
import pytest
from starlette.requests import Request

from cluster.api.openai_api import (
    INLINE_PROMPT_BYTES,
    LocalEngineClient,
    OpenAIServing,
    create_app,
    default_max_body_bytes,
)
from cluster.api.openai_prompts import max_token_bytes
from cluster.api.prometheus import parse_prometheus, render_prometheus
from cluster.engine.config import EngineConfig
from cluster.engine.errors import EngineDeadError, OverloadedError
from cluster.engine.metrics import Histogram
from scheduler import CompletionOutput, RequestOutput, SamplingParams

SCRIPT_TEXT = " one two three four five six seven eight nine ten"
MODEL = "fake-qwen3"


class FakeEngine:
    model_name = MODEL
    max_model_len = 64
    config = EngineConfig(max_num_seqs=8)

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.script = tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
        self.calls: list[tuple[list[int], SamplingParams, str, str | None]] = []
        self.aborted: list[str] = []
        self.dead: str | None = None
        self.overloaded = False
        self.fail_at: int | None = None  # raise an internal error at this step

    def token(self, i: int, t: int) -> int:
        return self.script[(i + t) % len(self.script)]

    def logprobs(self, i: int, t: int, k: int) -> dict[int, float]:
        lps = {self.token(i, t + 1 + j): -0.5 * (j + 1) for j in range(k)}
        lps[self.token(i, t)] = -0.25
        return lps

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str, cache_salt: str | None = None):
        sp = sampling_params
        if self.dead:
            raise EngineDeadError(self.dead)
        if self.overloaded:
            raise OverloadedError("3 requests are already waiting (max_waiting_requests=3)")
        if len(prompt_token_ids) + sp.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_token_ids)}) + max_tokens ({sp.max_tokens}) "
                             f"> max_model_len ({self.max_model_len})")
        self.calls.append((list(prompt_token_ids), sp, request_id, cache_salt))
        live = set(range(sp.n))
        finished = False
        try:
            for t in range(sp.max_tokens):
                await asyncio.sleep(0)
                if t == self.fail_at:
                    raise RuntimeError("step failed on node 10.0.0.7: Traceback (most recent "
                                       "call last): File /srv/worker.py")
                outs = []
                for i in sorted(live):
                    tok = self.token(i, t)
                    reason = ("stop" if tok in sp.stop_token_ids
                              else "length" if t == sp.max_tokens - 1 else None)
                    outs.append(CompletionOutput(
                        index=i, token_ids=[tok], text="" if reason == "stop" else self.text(tok),
                        finish_reason=reason, stop_reason=tok if reason == "stop" else None,
                        logprobs=None if sp.logprobs is None else [self.logprobs(i, t, sp.logprobs)]))
                    if reason:
                        live.discard(i)
                finished = not live
                yield RequestOutput(request_id, prompt_token_ids, outs, finished,
                                    num_cached_tokens=3)
                if finished:
                    return
        finally:
            if not finished:
                self.aborted.append(request_id)

    def text(self, tok: int) -> str:
        return self.tokenizer.decode([tok])

    def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)

    def check_ready(self) -> None:  # (AsyncLLMEngine's: also while it rebuilds its workers)
        self.check_health()

    def metrics(self) -> dict[str, Any]:
        ttft = Histogram((0.1, 1.0))
        for v in (0.05, 0.5, 3.0):
            ttft.observe(v)
        return {"num_requests_running": 2, "num_requests_waiting": 1, "num_requests_swapped": 0,
                "kv_cache_usage_perc": 0.25, "prefix_cache_queries": 40, "prefix_cache_hits": 16,
                "prompt_tokens_total": 40, "generation_tokens_total": 7,
                "num_preemptions_swap": 1, "num_preemptions_recompute": 2,
                "num_worker_recoveries": 0,
                "request_success_total": {"stop": 1, "length": 2, "abort": 0},
                "time_to_first_token_seconds": ttft,
                "inter_token_latency_seconds": Histogram((0.01,)),
                "e2e_request_latency_seconds": Histogram((1.0,))}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def engine(tokenizer: Any) -> FakeEngine:
    return FakeEngine(tokenizer)


def _call(engine: FakeEngine, tokenizer: Any, method: str, path: str, body: Any = None,
          api_key: str | None = None, headers: dict[str, str] | None = None,
          max_body_bytes: int | None = None) -> httpx.Response:
    """One request to a fresh app; `body` is bytes, str, an async iterator of byte chunks (sent
    chunked, without Content-Length) or anything else (sent as JSON)."""
    app = create_app(LocalEngineClient(engine), tokenizer, api_key=api_key,
                     max_body_bytes=max_body_bytes)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            content = (body if isinstance(body, (bytes, str)) or body is None
                       or hasattr(body, "__aiter__") else json.dumps(body))
            return await client.request(method, path, content=content, headers=headers)

    return asyncio.run(go())


def _sse_events(resp: httpx.Response) -> list[Any]:
    events = [line[len("data: "):] for line in resp.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_models_lists_the_served_model(engine: FakeEngine, tokenizer: Any) -> None:
    resp = _call(engine, tokenizer, "GET", "/v1/models")
    assert resp.status_code == 200
    data = resp.json()["data"]
    assert [(m["id"], m["object"], m["max_model_len"]) for m in data] == [(MODEL, "model", 64)]


def test_completion_returns_exact_text_per_choice_and_usage(engine: FakeEngine,
                                                            tokenizer: Any) -> None:
    resp = _call(engine, tokenizer, "POST", "/v1/completions",
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
    resp = _call(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": [5, 6, 7], "max_tokens": 3, "stream": True,
                  "stream_options": {"include_usage": True}})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(resp)
    deltas = [e["choices"][0] for e in events[:-1]]
    assert [d["text"] for d in deltas] == [tokenizer.decode([t]) for t in engine.script[:3]]
    assert [d["finish_reason"] for d in deltas] == [None, None, "length"]
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                   "prompt_tokens_details": {"cached_tokens": 3}}


def test_completion_batch_prompts_get_indices_prompt_major(engine: FakeEngine,
                                                           tokenizer: Any) -> None:
    resp = _call(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 2, "n": 2})
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    s = engine.script
    assert [c["text"] for c in body["choices"]] == [tokenizer.decode(s[0:2]),
                                                    tokenizer.decode(s[1:3])] * 2
    assert sorted(c[0] for c in engine.calls) == [[1, 2], [3, 4, 5]]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 8


def test_completion_echo_prepends_prompt(engine: FakeEngine, tokenizer: Any) -> None:
    resp = _call(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": "Hi", "max_tokens": 1, "echo": True})
    assert resp.json()["choices"][0]["text"] == "Hi" + tokenizer.decode(engine.script[:1])


def test_completion_logprobs_rank_top_tokens_and_offsets(engine: FakeEngine,
                                                         tokenizer: Any) -> None:
    resp = _call(engine, tokenizer, "POST", "/v1/completions",
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
    resp = _call(engine, tokenizer, "POST", "/v1/chat/completions",
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
    resp = _call(engine, tokenizer, "POST", "/v1/chat/completions", {"messages": messages})
    prompt_len = len(engine.calls[0][0])
    assert engine.calls[0][1].max_tokens == 64 - prompt_len
    assert resp.json()["usage"]["completion_tokens"] == 64 - prompt_len


def test_chat_stream_opens_with_role_and_ends_with_finish(engine: FakeEngine,
                                                          tokenizer: Any) -> None:
    resp = _call(engine, tokenizer, "POST", "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                  "max_tokens": 2, "stream": True, "stop_token_ids": [engine.script[1]]})
    events = _sse_events(resp)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    choices = [e["choices"][0] for e in events]
    assert [c["delta"] for c in choices] == [
        {"role": "assistant", "content": ""},
        {"content": tokenizer.decode(engine.script[:1])}, {}]
    assert [c["finish_reason"] for c in choices] == [None, None, "stop"]
    assert choices[-1]["stop_reason"] == engine.script[1]


def test_chat_logprobs_carry_top_logprobs(engine: FakeEngine, tokenizer: Any) -> None:
    resp = _call(engine, tokenizer, "POST", "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                  "logprobs": True, "top_logprobs": 1})
    content = resp.json()["choices"][0]["logprobs"]["content"]
    tok = tokenizer.decode(engine.script[:1])
    assert content == [{"token": tok, "logprob": -0.25, "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": tok, "logprob": -0.25,
                                          "bytes": list(tok.encode())}]}]


def test_every_sampling_field_reaches_the_engine(engine: FakeEngine, tokenizer: Any) -> None:
    _call(engine, tokenizer, "POST", "/v1/completions", {
        "prompt": "x", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "n": 1,
        "stop": ["\n"], "seed": 42, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
        "min_tokens": 2, "stop_token_ids": [7], "skip_special_tokens": False,
        "include_stop_str_in_output": True, "cache_salt": "tenant-a"})
    _, sp, rid, salt = engine.calls[0]
    assert sp == SamplingParams(
        n=1, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=42, max_tokens=5,
        min_tokens=2, stop=["\n"], stop_token_ids=[7], ignore_eos=True, logprobs=None,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
        skip_special_tokens=False, include_stop_str_in_output=True)
    assert rid.startswith("cmpl-") and salt == "tenant-a"


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


@pytest.mark.parametrize("body, param, needle", [
    (b"{not json", None, "Invalid JSON"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens", "max_tokens: Input should be a valid integer"),
    ({"prompt": "x", "stream": 1}, "stream", "stream: Input should be a valid boolean"),
    ({"max_tokens": 3}, "prompt", "prompt: Field required"),
    ({"prompt": "x", "temperature": 300.0}, "temperature", "temperature must be [0, 100]; got 300.0"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1; got 0"),
    ({"prompt": [], "max_tokens": 1}, "prompt", "prompt is empty"),
    ({"prompt": [151935]}, "prompt", "token id 151935 is outside the vocabulary"),
    ({"prompt": "x", "suffix": "y"}, "suffix", "suffix is not supported"),
])
def test_bad_completion_requests_are_400_with_openai_error(engine: FakeEngine, tokenizer: Any,
                                                          body: Any, param: str | None,
                                                          needle: str) -> None:
    resp = _call(engine, tokenizer, "POST", "/v1/completions", body)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert needle in err["message"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param)
    assert engine.calls == []


def test_prompt_beyond_max_model_len_is_400_naming_both_numbers(engine: FakeEngine,
                                                                tokenizer: Any) -> None:
    resp = _call(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": list(range(100, 150)), "max_tokens": 20})
    assert resp.status_code == 400
    msg = resp.json()["error"]["message"]
    assert "maximum context length is 64 tokens" in msg
    assert "you requested 70 tokens (50 in the prompt, 20 in the completion)" in msg


def test_unknown_model_is_404(engine: FakeEngine, tokenizer: Any) -> None:
    resp = _call(engine, tokenizer, "POST", "/v1/chat/completions",
                 {"model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"


def test_engine_overload_is_429_and_dead_engine_503_with_retry_after(
        engine: FakeEngine, tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    engine.overloaded = True
    resp = _call(engine, tokenizer, "POST", "/v1/completions", {"prompt": "x"})
    assert (resp.status_code, resp.headers["retry-after"]) == (429, "1")
    assert "max_waiting_requests=3" in resp.json()["error"]["message"]
    # What killed the engine (here a stand-in for a Ray traceback with a node's address) goes
    # to the log under the request id; the client gets the id and a fixed message.
    detail = "RayActorError: worker rank 1 died on node 10.0.0.7 (/tmp/ray/session_x)"
    engine.overloaded, engine.dead = False, detail
    resp = _call(engine, tokenizer, "POST", "/v1/completions", {"prompt": "x", "stream": True})
    assert (resp.status_code, resp.headers["retry-after"]) == (503, "1")
    err = resp.json()["error"]
    assert err["code"] == "engine_dead"
    rid = re.fullmatch(r"the engine is not available; the replica is being replaced, retry "
                       r"shortly \(request id (cmpl-[0-9a-f]{32})\)", err["message"])[1]
    health = _call(engine, tokenizer, "GET", "/health")
    hid = health.headers["x-request-id"]
    assert health.status_code == 503
    assert health.json()["error"]["message"] == f"the engine is not healthy (request id {hid})"
    logged = [r.getMessage() for r in caplog.records]
    assert f"request {rid}: the engine is dead: {detail}" in logged
    assert f"health check {hid}: the engine is not healthy: {detail}" in logged


def test_health_is_200_while_the_engine_lives(engine: FakeEngine, tokenizer: Any) -> None:
    assert _call(engine, tokenizer, "GET", "/health").status_code == 200


def test_api_key_is_required_on_v1_routes_only(engine: FakeEngine, tokenizer: Any) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    missing = _call(engine, tokenizer, "POST", "/v1/completions", body, api_key="s3cret")
    wrong = _call(engine, tokenizer, "GET", "/v1/models", api_key="s3cret",
                  headers={"Authorization": "Bearer nope"})
    right = _call(engine, tokenizer, "POST", "/v1/completions", body, api_key="s3cret",
                  headers={"Authorization": "Bearer s3cret"})
    health = _call(engine, tokenizer, "GET", "/health", api_key="s3cret")
    assert (missing.status_code, wrong.status_code, right.status_code) == (401, 401, 200)
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert health.status_code == 200


def test_bearer_scheme_is_case_insensitive(engine: FakeEngine, tokenizer: Any) -> None:
    def status(authorization: str) -> int:
        return _call(engine, tokenizer, "GET", "/v1/models", api_key="s3cret",
                     headers={"Authorization": authorization}).status_code

    assert [status(a) for a in ("bearer s3cret", "BEARER s3cret", "Bearer  s3cret ")] == [200] * 3
    assert [status(a) for a in ("Basic s3cret", "bearers3cret", "bearer S3CRET")] == [401] * 3


def test_every_response_carries_a_request_id(engine: FakeEngine, tokenizer: Any) -> None:
    ok = _call(engine, tokenizer, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
    bad = _call(engine, tokenizer, "POST", "/v1/completions", b"{")
    missing = _call(engine, tokenizer, "GET", "/v1/nothing")
    ids = [r.headers["x-request-id"] for r in (ok, bad, missing)]
    assert len(set(ids)) == 3 and all(re.fullmatch("[0-9a-f]{32}", i) for i in ids)
    # A request that has one (Serve's proxy sets it, and sends it back itself) keeps it.
    given = _call(engine, tokenizer, "GET", "/v1/models", headers={"X-Request-Id": "abc-1"})
    assert given.headers.get_list("x-request-id") == []
    # The engine's id is the response's, new for every request whatever the client sends.
    assert re.fullmatch("cmpl-[0-9a-f]{32}", ok.json()["id"])
    assert engine.calls[0][2] == ok.json()["id"]


@pytest.mark.parametrize("method, path, status, message", [
    ("GET", "/v1/embeddings", 404, "Invalid URL (GET /v1/embeddings); this server serves"),
    ("DELETE", "/v1/models", 405, "Method not allowed (DELETE /v1/models); allowed: GET"),
    ("GET", "/v1/completions", 405, "Method not allowed (GET /v1/completions); allowed: POST"),
])
def test_unknown_routes_and_methods_get_openai_errors(engine: FakeEngine, tokenizer: Any,
                                                      method: str, path: str, status: int,
                                                      message: str) -> None:
    resp = _call(engine, tokenizer, method, path)
    assert resp.status_code == status
    assert resp.json()["error"]["message"].startswith(message)
    assert resp.json()["error"]["type"] == "invalid_request_error"
    if status == 405:
        assert resp.headers["allow"] == message.rsplit(" ", 1)[1]


def test_non_json_content_type_is_415(engine: FakeEngine, tokenizer: Any) -> None:
    form = _call(engine, tokenizer, "POST", "/v1/completions", b"prompt=x",
                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415
    assert form.json()["error"]["message"].startswith(
        "Content-Type 'application/x-www-form-urlencoded' is not supported")
    charset = _call(engine, tokenizer, "POST", "/v1/completions",
                    json.dumps({"prompt": "x", "max_tokens": 1}),
                    headers={"Content-Type": "application/json; charset=utf-8"})
    assert charset.status_code == 200 and engine.calls


def test_body_over_the_limit_is_413_counted_or_declared(engine: FakeEngine,
                                                        tokenizer: Any) -> None:
    body = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()

    async def chunked() -> Any:  # no Content-Length: the limit is counted as it arrives
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    for content, size in ((body, f"{len(body)}"), (chunked(), "at least 5000")):
        resp = _call(engine, tokenizer, "POST", "/v1/completions", content, max_body_bytes=4096)
        assert resp.status_code == 413
        assert resp.json()["error"] == {
            "message": f"the request body is {size} bytes; this server accepts at most 4096 "
                       "(max_request_body_bytes)",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    assert engine.calls == []
    fits = _call(engine, tokenizer, "POST", "/v1/completions", body, max_body_bytes=len(body))
    assert fits.status_code == 400 and "maximum context length" in fits.json()["error"]["message"]


def test_default_body_limit_follows_max_model_len() -> None:
    assert default_max_body_bytes(4096) == 1 << 20
    assert default_max_body_bytes(131072) == 32 * 131072


def test_text_too_long_for_any_tokenization_is_refused_untokenized(
        engine: FakeEngine, tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    encoded: list[int] = []
    real_encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode",
                        lambda text, **kw: encoded.append(len(text)) or real_encode(text, **kw))
    longest = max_token_bytes(tokenizer)
    assert longest == 128  # Qwen3's longest token: 128 spaces, one byte each
    # 64 tokens of context hold at most 63 prompt tokens, so 63 * 128 bytes can still fit.
    fits = _call(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": " " * (63 * longest), "max_tokens": 1})
    assert fits.status_code == 200 and encoded == [63 * longest]
    resp = _call(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": " " * (63 * longest + 1), "max_tokens": 1})
    assert resp.status_code == 400 and encoded == [63 * longest]
    assert resp.json()["error"]["message"] == (
        "This model's maximum context length is 64 tokens. However, the 8065 bytes of text in "
        "`prompt` make at least 64 tokens. Please reduce the length of the prompt.")
    chat = _call(engine, tokenizer, "POST", "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "y" * 10000}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert encoded == [63 * longest]


def test_big_prompts_are_tokenized_off_the_event_loop(engine: FakeEngine, tokenizer: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    real_encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: threads.append(
        threading.current_thread().name) or real_encode(text, **kw))
    for size in (100, INLINE_PROMPT_BYTES + 1):
        _call(engine, tokenizer, "POST", "/v1/completions",
              {"prompt": [" a b c d"] * (size // 8 + 1), "max_tokens": 1})
    small, big = threads[0], threads[-1]
    assert small == "MainThread" and big.startswith("prompts")


def test_message_without_content_or_tool_calls_is_400(engine: FakeEngine,
                                                      tokenizer: Any) -> None:
    resp = _call(engine, tokenizer, "POST", "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant"}]})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == (
        "messages[1] (assistant) has neither content nor tool_calls; send its text as content")
    empty = _call(engine, tokenizer, "POST", "/v1/chat/completions",
                  {"messages": [{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": ""}], "max_tokens": 1})
    assert empty.status_code == 200 and len(engine.calls) == 1


def test_n_beyond_max_num_seqs_is_400_naming_n(engine: FakeEngine, tokenizer: Any) -> None:
    resp = _call(engine, tokenizer, "POST", "/v1/completions", {"prompt": "x", "n": 1000})
    assert resp.status_code == 400 and engine.calls == []
    assert resp.json()["error"]["param"] == "n"
    assert resp.json()["error"]["message"] == ("n=1000 is more samples than this server runs at "
                                               "once (max_num_seqs=8); ask for at most 8")


@pytest.mark.parametrize("stream", [False, True])
def test_internal_errors_show_the_request_id_and_log_the_details(
        engine: FakeEngine, tokenizer: Any, caplog: pytest.LogCaptureFixture,
        stream: bool) -> None:
    engine.fail_at = 1  # after the first token: in-band for a stream, a 500 otherwise
    resp = _call(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": "x", "max_tokens": 5, "stream": stream})
    rid = engine.calls[0][2]
    error = {"message": f"internal server error (request id {rid})", "type": "server_error",
             "param": None, "code": None}
    if stream:
        assert resp.status_code == 200
        first, *_, last = _sse_events(resp)
        assert first["id"] == rid and last == {"error": error}
    else:
        assert resp.status_code == 500 and resp.json() == {"error": error}
    assert "10.0.0.7" not in resp.text and "Traceback" not in resp.text
    (record,) = [r for r in caplog.records if r.getMessage() == f"request {rid} failed"]
    assert "step failed on node 10.0.0.7" in str(record.exc_info[1])


def test_metrics_render_vllm_names_in_prometheus_format(engine: FakeEngine,
                                                        tokenizer: Any) -> None:
    resp = _call(engine, tokenizer, "GET", "/metrics")
    assert resp.status_code == 200
    m = parse_prometheus(resp.text)
    label = 'model_name="fake-qwen3"'
    assert m[f"vllm:num_requests_running{{{label}}}"] == 2
    assert m[f"vllm:num_requests_waiting{{{label}}}"] == 1
    assert m[f"vllm:kv_cache_usage_perc{{{label}}}"] == 0.25
    assert m[f"vllm:prefix_cache_queries_total{{{label}}}"] == 40
    assert m[f"vllm:prefix_cache_hits_total{{{label}}}"] == 16
    assert m[f"vllm:prompt_tokens_total{{{label}}}"] == 40
    assert m[f"vllm:generation_tokens_total{{{label}}}"] == 7
    assert m[f"vllm:num_preemptions_total{{{label}}}"] == 3
    assert m[f"vllm:num_preemptions_swap_total{{{label}}}"] == 1
    assert m[f'vllm:request_success_total{{{label},finished_reason="length"}}'] == 2
    ttft = "vllm:time_to_first_token_seconds"
    assert [m[f'{ttft}_bucket{{{label},le="{le}"}}'] for le in ("0.1", "1.0", "+Inf")] == [1, 2, 3]
    assert (m[f"{ttft}_sum{{{label}}}"], m[f"{ttft}_count{{{label}}}"]) == (3.55, 3)
    assert "# TYPE vllm:prompt_tokens counter" in resp.text
    assert "# TYPE vllm:inter_token_latency_seconds histogram" in resp.text


def test_metrics_of_two_replicas_are_summed(engine: FakeEngine) -> None:
    m = parse_prometheus(render_prometheus([engine.metrics(), engine.metrics()], "m"))
    assert m['vllm:num_requests_running{model_name="m"}'] == 4
    assert m['vllm:kv_cache_usage_perc{model_name="m"}'] == 0.25
    assert m['vllm:time_to_first_token_seconds_count{model_name="m"}'] == 6


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


class _FakeRayMetric:
    def __init__(self, name: str, description: str = "", tag_keys: tuple = (),
                 boundaries: list[float] | None = None) -> None:
        self.name, self.boundaries = name, boundaries
        self.calls: list[tuple[str, float, dict[str, str]]] = []

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("set", value, tags))

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("inc", value, tags))

    def observe(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("observe", value, tags))


class _FakeRayMetrics:
    def __init__(self) -> None:
        self.made: dict[str, _FakeRayMetric] = {}

    def _make(self, name: str, *args: Any, **kw: Any) -> _FakeRayMetric:
        self.made[name] = _FakeRayMetric(name, *args, **kw)
        return self.made[name]

    Gauge = Counter = Histogram = _make


def test_ray_export_sends_counter_deltas_and_replays_histogram_buckets(
        engine: FakeEngine) -> None:
    from cluster.api.prometheus import RayMetricsExporter

    fake = _FakeRayMetrics()
    exporter = RayMetricsExporter("m", ray_metrics=fake)
    snap = engine.metrics()
    exporter.update(snap)
    snap["prompt_tokens_total"] = 45
    snap["time_to_first_token_seconds"].observe(0.07)
    exporter.update(snap)
    tags = {"model_name": "m"}
    assert fake.made["vllm_prompt_tokens"].calls == [("inc", 40, tags), ("inc", 5, tags)]
    assert fake.made["vllm_num_requests_running"].calls == [("set", 2, tags)] * 2
    ttft = fake.made["vllm_time_to_first_token_seconds"]
    assert ttft.boundaries == [0.1, 1.0]
    # 0.05 -> le 0.1, 0.5 -> le 1.0, 3.0 -> +Inf (replayed at 2.0), then the new 0.07.
    assert [c[1] for c in ttft.calls] == [0.1, 1.0, 2.0, 0.1]
    assert fake.made["vllm_request_success"].calls == [
        ("inc", 1, {**tags, "finished_reason": "stop"}),
        ("inc", 2, {**tags, "finished_reason": "length"})]


def test_pack_output_round_trip_drops_only_the_prompt() -> None:
    from cluster.api.serve_app import pack_output, unpack_output

    out = RequestOutput("cmpl-1", [11, 12, 13], [
        CompletionOutput(0, [5, 6], "ab", None, None, None),
        CompletionOutput(1, [7], "c", "stop", 151645, [{7: -0.25, 9: -1.5}])],
        finished=False, num_cached_tokens=16)
    packed = pack_output(out)
    assert packed == (False, 16, ((0, [5, 6], "ab", None, None, None),
                                  (1, [7], "c", "stop", 151645, [{7: -0.25, 9: -1.5}])))
    assert unpack_output("cmpl-1", [11, 12, 13], packed) == out
