"""The OpenAI HTTP layer's refusals and limits over a deterministic fake engine
(fake_engine.py): bad requests, context length, overload and a dead engine, API keys,
request ids, unknown routes, body size and type limits, huge prompts, internal errors.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import pytest
from fake_engine import FakeEngine, fetch, sse_events

from cluster.api import openai_prompts
from cluster.api.openai_api import INLINE_PROMPT_BYTES, default_max_body_bytes
from cluster.api.openai_prompts import max_token_bytes


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
    ({"prompt": "x", "logit_bias": {"the": 5}}, "logit_bias",
     "logit_bias keys are token ids (integers >= 0, as strings); got 'the'"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias",
     "logit_bias must be a map of token ids (integers >= 0) to values in [-100, 100]"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs",
     "prompt_logprobs must be an integer in [0, 20] or None; got 21"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs",
     "prompt_logprobs must be an integer in [0, 20] or None; got -1"),
    ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs",
     "logprobs must be an integer in [0, 20] or None; got 21"),
    ({"prompt": "x", "echo": True, "logprobs": -2}, "logprobs",
     "logprobs must be an integer in [0, 20] or None; got -2"),
])
def test_bad_completion_requests_are_400_with_openai_error(engine: FakeEngine, tokenizer: Any,
                                                          body: Any, param: str | None,
                                                          needle: str) -> None:
    resp = fetch(engine, tokenizer, "POST", "/v1/completions", body)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert needle in err["message"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param)
    assert engine.calls == []


def test_prompt_beyond_max_model_len_is_400_naming_both_numbers(engine: FakeEngine,
                                                                tokenizer: Any) -> None:
    resp = fetch(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": list(range(100, 150)), "max_tokens": 20})
    assert resp.status_code == 400
    msg = resp.json()["error"]["message"]
    assert "maximum context length is 64 tokens" in msg
    assert "you requested 70 tokens (50 in the prompt, 20 in the completion)" in msg


def test_unknown_model_is_404(engine: FakeEngine, tokenizer: Any) -> None:
    resp = fetch(engine, tokenizer, "POST", "/v1/chat/completions",
                 {"model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"


def test_engine_overload_is_429_and_dead_engine_503_with_retry_after(
        engine: FakeEngine, tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    engine.overloaded = True
    resp = fetch(engine, tokenizer, "POST", "/v1/completions", {"prompt": "x"})
    assert (resp.status_code, resp.headers["retry-after"]) == (429, "1")
    assert "max_waiting_requests=3" in resp.json()["error"]["message"]
    # What killed the engine (here a stand-in for a Ray traceback with a node's address) goes
    # to the log under the request id; the client gets the id and a fixed message.
    detail = "RayActorError: worker rank 1 died on node 10.0.0.7 (/tmp/ray/session_x)"
    engine.overloaded, engine.dead = False, detail
    resp = fetch(engine, tokenizer, "POST", "/v1/completions", {"prompt": "x", "stream": True})
    assert (resp.status_code, resp.headers["retry-after"]) == (503, "1")
    err = resp.json()["error"]
    assert err["code"] == "engine_dead"
    rid = re.fullmatch(r"the engine is not available; the replica is being replaced, retry "
                       r"shortly \(request id (cmpl-[0-9a-f]{32})\)", err["message"])[1]
    health = fetch(engine, tokenizer, "GET", "/health")
    hid = health.headers["x-request-id"]
    assert health.status_code == 503
    assert health.json()["error"]["message"] == f"the engine is not healthy (request id {hid})"
    logged = [r.getMessage() for r in caplog.records]
    assert f"request {rid}: the engine is dead: {detail}" in logged
    assert f"health check {hid}: the engine is not healthy: {detail}" in logged


def test_health_is_200_while_the_engine_lives(engine: FakeEngine, tokenizer: Any) -> None:
    assert fetch(engine, tokenizer, "GET", "/health").status_code == 200


def test_api_key_is_required_on_v1_routes_only(engine: FakeEngine, tokenizer: Any) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    missing = fetch(engine, tokenizer, "POST", "/v1/completions", body, api_key="s3cret")
    wrong = fetch(engine, tokenizer, "GET", "/v1/models", api_key="s3cret",
                  headers={"Authorization": "Bearer nope"})
    right = fetch(engine, tokenizer, "POST", "/v1/completions", body, api_key="s3cret",
                  headers={"Authorization": "Bearer s3cret"})
    health = fetch(engine, tokenizer, "GET", "/health", api_key="s3cret")
    assert (missing.status_code, wrong.status_code, right.status_code) == (401, 401, 200)
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert health.status_code == 200


def test_bearer_scheme_is_case_insensitive(engine: FakeEngine, tokenizer: Any) -> None:
    def status(authorization: str) -> int:
        return fetch(engine, tokenizer, "GET", "/v1/models", api_key="s3cret",
                     headers={"Authorization": authorization}).status_code

    assert [status(a) for a in ("bearer s3cret", "BEARER s3cret", "Bearer  s3cret ")] == [200] * 3
    assert [status(a) for a in ("Basic s3cret", "bearers3cret", "bearer S3CRET")] == [401] * 3


def test_every_response_carries_a_request_id(engine: FakeEngine, tokenizer: Any) -> None:
    ok = fetch(engine, tokenizer, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
    bad = fetch(engine, tokenizer, "POST", "/v1/completions", b"{")
    missing = fetch(engine, tokenizer, "GET", "/v1/nothing")
    ids = [r.headers["x-request-id"] for r in (ok, bad, missing)]
    assert len(set(ids)) == 3 and all(re.fullmatch("[0-9a-f]{32}", i) for i in ids)
    # A request that has one (Serve's proxy sets it, and sends it back itself) keeps it.
    given = fetch(engine, tokenizer, "GET", "/v1/models", headers={"X-Request-Id": "abc-1"})
    assert given.headers.get_list("x-request-id") == []
    # The engine's id is the response's, new for every request whatever the client sends.
    assert re.fullmatch("cmpl-[0-9a-f]{32}", ok.json()["id"])
    assert engine.calls[0][2] == ok.json()["id"]


@pytest.mark.parametrize("method, path, status, message", [
    ("GET", "/v1/images", 404, "Invalid URL (GET /v1/images); this server serves"),
    ("GET", "/v1/embeddings", 405, "Method not allowed (GET /v1/embeddings); allowed: POST"),
    ("DELETE", "/v1/models", 405, "Method not allowed (DELETE /v1/models); allowed: GET"),
    ("GET", "/v1/completions", 405, "Method not allowed (GET /v1/completions); allowed: POST"),
])
def test_unknown_routes_and_methods_get_openai_errors(engine: FakeEngine, tokenizer: Any,
                                                      method: str, path: str, status: int,
                                                      message: str) -> None:
    resp = fetch(engine, tokenizer, method, path)
    assert resp.status_code == status
    assert resp.json()["error"]["message"].startswith(message)
    assert resp.json()["error"]["type"] == "invalid_request_error"
    if status == 405:
        assert resp.headers["allow"] == message.rsplit(" ", 1)[1]


def test_non_json_content_type_is_415(engine: FakeEngine, tokenizer: Any) -> None:
    form = fetch(engine, tokenizer, "POST", "/v1/completions", b"prompt=x",
                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415
    assert form.json()["error"]["message"].startswith(
        "Content-Type 'application/x-www-form-urlencoded' is not supported")
    charset = fetch(engine, tokenizer, "POST", "/v1/completions",
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
        resp = fetch(engine, tokenizer, "POST", "/v1/completions", content, max_body_bytes=4096)
        assert resp.status_code == 413
        assert resp.json()["error"] == {
            "message": f"the request body is {size} bytes; this server accepts at most 4096 "
                       "(max_request_body_bytes)",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    assert engine.calls == []
    fits = fetch(engine, tokenizer, "POST", "/v1/completions", body, max_body_bytes=len(body))
    assert fits.status_code == 400 and "maximum context length" in fits.json()["error"]["message"]


def test_default_body_limit_follows_max_model_len() -> None:
    assert default_max_body_bytes(4096) == 1 << 20
    assert default_max_body_bytes(131072) == 32 * 131072


def _spy_on_tokenization(monkeypatch: pytest.MonkeyPatch, record: Any) -> None:
    """Every prompt text the app's PromptProcessor tokenizes goes through `record` first."""
    real = openai_prompts.text_encoder

    def spying(tokenizer: Any) -> Any:
        encode = real(tokenizer)
        return lambda text: record(text) or encode(text)

    monkeypatch.setattr(openai_prompts, "text_encoder", spying)


def test_text_too_long_for_any_tokenization_is_refused_untokenized(
        engine: FakeEngine, tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    encoded: list[int] = []
    _spy_on_tokenization(monkeypatch, lambda text: encoded.append(len(text)))
    longest = max_token_bytes(tokenizer)
    assert longest == 128  # Qwen3's longest token: 128 spaces, one byte each
    # 64 tokens of context hold at most 63 prompt tokens, so 63 * 128 bytes can still fit.
    fits = fetch(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": " " * (63 * longest), "max_tokens": 1})
    assert fits.status_code == 200 and encoded == [63 * longest]
    resp = fetch(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": " " * (63 * longest + 1), "max_tokens": 1})
    assert resp.status_code == 400 and encoded == [63 * longest]
    assert resp.json()["error"]["message"] == (
        "This model's maximum context length is 64 tokens. However, the 8065 bytes of text in "
        "`prompt` make at least 64 tokens. Please reduce the length of the prompt.")
    chat = fetch(engine, tokenizer, "POST", "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "y" * 10000}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert encoded == [63 * longest]


def test_big_prompts_are_tokenized_off_the_event_loop(engine: FakeEngine, tokenizer: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    _spy_on_tokenization(monkeypatch, lambda text: threads.append(threading.current_thread().name))
    for size in (100, INLINE_PROMPT_BYTES + 1):
        fetch(engine, tokenizer, "POST", "/v1/completions",
              {"prompt": [" a b c d"] * (size // 8 + 1), "max_tokens": 1})
    small, big = threads[0], threads[-1]
    assert small == "MainThread" and big.startswith("prompts")


def test_message_without_content_or_tool_calls_is_400(engine: FakeEngine,
                                                      tokenizer: Any) -> None:
    resp = fetch(engine, tokenizer, "POST", "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant"}]})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == (
        "messages[1] (assistant) has neither content nor tool_calls; send its text as content")
    empty = fetch(engine, tokenizer, "POST", "/v1/chat/completions",
                  {"messages": [{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": ""}], "max_tokens": 1})
    assert empty.status_code == 200 and len(engine.calls) == 1


def test_n_beyond_max_num_seqs_is_400_naming_n(engine: FakeEngine, tokenizer: Any) -> None:
    resp = fetch(engine, tokenizer, "POST", "/v1/completions", {"prompt": "x", "n": 1000})
    assert resp.status_code == 400 and engine.calls == []
    assert resp.json()["error"]["param"] == "n"
    assert resp.json()["error"]["message"] == ("n=1000 is more samples than this server runs at "
                                               "once (max_num_seqs=8); ask for at most 8")


@pytest.mark.parametrize("stream", [False, True])
def test_internal_errors_show_the_request_id_and_log_the_details(
        engine: FakeEngine, tokenizer: Any, caplog: pytest.LogCaptureFixture,
        stream: bool) -> None:
    engine.fail_at = 1  # after the first token: in-band for a stream, a 500 otherwise
    resp = fetch(engine, tokenizer, "POST", "/v1/completions",
                 {"prompt": "x", "max_tokens": 5, "stream": stream})
    rid = engine.calls[0][2]
    error = {"message": f"internal server error (request id {rid})", "type": "server_error",
             "param": None, "code": None}
    if stream:
        assert resp.status_code == 200
        first, *_, last = sse_events(resp)
        assert first["id"] == rid and last == {"error": error}
    else:
        assert resp.status_code == 500 and resp.json() == {"error": error}
    assert "10.0.0.7" not in resp.text and "Traceback" not in resp.text
    (record,) = [r for r in caplog.records if r.getMessage() == f"request {rid} failed"]
    assert "step failed on node 10.0.0.7" in str(record.exc_info[1])
