"""Direct streaming (`direct_streaming: true`, manifests/qwen3-tiny-direct.yaml): the LLMServer
replica serves the OpenAI routes itself. The app's shape and the manifest checks without Ray;
the admission gate (ongoing, queued, refused) on a fake stream; then the real stack over HTTP
(Ray Serve, HAProxy where the session runs it, tp 2 on CPU): greedy outputs equal the offline
engine's, streams, the replica's id, /metrics, overload and a client's disconnect."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from serve_apps import check_disconnect_mid_stream_aborts, metrics, serve_app, wait_idle

from cluster.api.openai_errors import map_exception

MANIFEST = Path(__file__).resolve().parents[3] / "manifests" / "qwen3-tiny-direct.yaml"
API_KEY = "direct-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_ONGOING = 4
MAX_QUEUED = 4


def _manifest_args() -> dict[str, Any]:
    return dict(yaml.safe_load(MANIFEST.read_text())["applications"][0]["args"])


# --- the app's shape and the manifest's checks (no Ray) ---------------------------------------

def test_the_app_is_one_llm_deployment_that_serves_http() -> None:
    from cluster.api.direct_app import DIRECT_EXTRA_ONGOING, DirectLLMServer
    from cluster.api.serve_app import build_app

    app = build_app({**_manifest_args(), "api_key": "k"})
    deployment = app._bound_deployment
    assert deployment.name == "LLMServer"
    assert issubclass(deployment.func_or_class, DirectLLMServer)
    config = deployment._deployment_config
    # Serve's own limits sit above the replica's gate, which answers overload itself.
    assert config.max_ongoing_requests == 64 + 128 + DIRECT_EXTRA_ONGOING
    assert config.max_queued_requests == 128
    assert config.graceful_shutdown_timeout_s == 600.0  # (the ingress's: no hand-off)
    assert config.request_router_config.request_router_class.endswith("PowerOfTwoChoicesRequestRouter")
    engine_args, spec, api_key = deployment.init_args
    assert (engine_args["model"], engine_args["tensor_parallel_size"]) == ("qwen3-tiny", 2)
    assert (spec["model"], spec["tool_call_parser"], api_key) == ("qwen3-tiny", "hermes", "k")
    assert deployment.init_kwargs == {"limits": (64, 128)}
    timeout = build_app({**_manifest_args(), "graceful_shutdown_timeout_s": 5})
    assert timeout._bound_deployment._deployment_config.graceful_shutdown_timeout_s == 5.0


@pytest.mark.parametrize("extra, message", [
    ({"ingress_num_cpus": 0.1}, "remove ['ingress_num_cpus']"),
    ({"request_router": "prefix_aware", "router_imbalance_abs": 4},
     "remove ['request_router', 'router_imbalance_abs']"),
    ({"direct_streaming": "yes"}, "direct_streaming must be true or false; got 'yes'"),
    ({"num_replicas": 2, "enable_lora": True, "allow_runtime_lora_updating": True},
     "allow_runtime_lora_updating with direct_streaming needs one replica"),
    ({"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}, "enable_lora": True,
      "allow_runtime_lora_updating": True},
     "allow_runtime_lora_updating with direct_streaming needs one replica"),
])
def test_keys_direct_streaming_has_no_use_for_are_refused(extra: dict[str, Any],
                                                          message: str) -> None:
    from cluster.api.serve_app import check_args

    with pytest.raises(ValueError) as e:
        check_args({**_manifest_args(), **extra})
    assert message in str(e.value)


def test_direct_streaming_with_several_models_or_pd_is_refused() -> None:
    from cluster.api.serve_app import check_args

    one = {"model": "qwen3-tiny", "device": "cpu", "direct_streaming": True}
    with pytest.raises(ValueError, match="direct_streaming serves one model .* with models"):
        check_args({"models": [one]})
    with pytest.raises(ValueError, match="direct_streaming serves one model .* with pd"):
        check_args({"model": "qwen3-tiny", "device": "cpu",
                    "pd": {"prefill": {"direct_streaming": True}, "decode": {}}})


def test_one_replica_may_load_adapters_at_runtime() -> None:
    from cluster.api.serve_app import check_args

    check_args({**_manifest_args(), "enable_lora": True, "allow_runtime_lora_updating": True})


# --- the replica's admission gate -------------------------------------------------------------

def test_the_gate_runs_ongoing_queues_queued_and_refuses_the_rest_with_a_503() -> None:
    from cluster.api.direct_app import Admission

    async def go() -> None:
        gate = Admission(ongoing=1, queued=1)
        release = asyncio.Event()
        started: list[str] = []

        async def stream(name: str) -> AsyncIterator[str]:
            started.append(name)
            await release.wait()
            yield name

        async def drain(name: str) -> list[str]:
            return [x async for x in gate.stream(lambda: stream(name))]

        first = asyncio.create_task(drain("a"))
        second = asyncio.create_task(drain("b"))
        await asyncio.sleep(0.01)
        assert (started, gate.held) == (["a"], 2)  # "b" waits for "a"'s slot
        with pytest.raises(Exception) as refused:
            await drain("c")
        err = map_exception(refused.value, "r")
        assert (err.status, err.code, err.retry_after) == (503, "service_unavailable", 1.0)
        assert "1 running and 1 queued" in err.message
        release.set()
        assert (await first, await second) == (["a"], ["b"])
        assert gate.held == 0

        # A stream closed early, or one that fails, gives its place back.
        release.clear()
        early = gate.stream(lambda: stream("d"))
        task = asyncio.create_task(early.__anext__())
        await asyncio.sleep(0.01)
        assert gate.held == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await early.aclose()
        assert gate.held == 0

        async def failing() -> AsyncIterator[str]:
            raise ValueError("bad")
            yield "never"

        with pytest.raises(ValueError):
            [x async for x in gate.stream(failing)]
        assert gate.held == 0

    asyncio.run(go())


def test_an_unbounded_queue_never_refuses() -> None:
    from cluster.api.direct_app import Admission

    async def go() -> list[list[int]]:
        gate = Admission(ongoing=1, queued=-1)

        async def stream(i: int) -> AsyncIterator[int]:
            await asyncio.sleep(0)
            yield i

        async def drain(i: int) -> list[int]:
            return [x async for x in gate.stream(lambda: stream(i))]

        return await asyncio.gather(*(drain(i) for i in range(50)))

    assert asyncio.run(go()) == [[i] for i in range(50)]


# --- the real stack ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_url(ray_cluster: None) -> Iterator[str]:
    args = _manifest_args()
    args.update(api_key=API_KEY, max_ongoing_requests=MAX_ONGOING,
                max_queued_requests=MAX_QUEUED)
    with serve_app(args, "qwen3-direct") as url:
        yield url


@pytest.fixture(scope="module")
def offline(tiny_model_path: str) -> Iterator[Any]:
    from cluster import LLM

    llm = LLM("qwen3-tiny", tensor_parallel_size=1)
    yield llm
    llm.shutdown()


def _complete(base_url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", headers=AUTH, timeout=120,
                      json={"model": "qwen3-tiny", "temperature": 0, "ignore_eos": True, **body})


@pytest.mark.slow
def test_the_app_has_no_ingress_deployment(base_url: str) -> None:
    from ray import serve

    app = serve.status().applications["qwen3-direct"]
    assert list(app.deployments) == ["LLMServer"]
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200
    models = httpx.get(f"{base_url}/v1/models", headers=AUTH, timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["qwen3-tiny"]
    assert httpx.get(f"{base_url}/v1/models", timeout=30).status_code == 401


@pytest.mark.slow
def test_greedy_over_http_equals_offline_and_names_the_replica(base_url: str,
                                                               offline: Any) -> None:
    from ray import serve

    from scheduler import SamplingParams

    prompt = "The capital of France is"
    resp = _complete(base_url, prompt=prompt, max_tokens=12)
    assert resp.status_code == 200, resp.text
    local = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                      ignore_eos=True), use_tqdm=False)[0]
    assert resp.json()["choices"][0]["text"] == local.outputs[0].text
    assert resp.json()["usage"]["prompt_tokens"] == len(local.prompt_token_ids)
    replicas = serve.status().applications["qwen3-direct"].deployments["LLMServer"]
    assert replicas.replica_states == {"RUNNING": 1}
    assert resp.headers["x-replica-id"] and len(resp.headers["x-replica-id"]) == 8

    messages = [{"role": "user", "content": "Say hi"}]
    chat = httpx.post(f"{base_url}/v1/chat/completions", headers=AUTH, timeout=120, json={
        "model": "qwen3-tiny", "messages": messages, "max_tokens": 10, "temperature": 0,
        "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    local = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    assert chat.json()["choices"][0]["message"]["content"] == local.outputs[0].text


@pytest.mark.slow
def test_stream_equals_non_stream(base_url: str) -> None:
    whole = _complete(base_url, prompt="One, two,", max_tokens=9).json()
    stream = _complete(base_url, prompt="One, two,", max_tokens=9, stream=True,
                       stream_options={"include_usage": True})
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        whole["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
    assert stream.text.rstrip().endswith("data: [DONE]")


@pytest.mark.slow
def test_metrics_count_one_request_exactly(base_url: str) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(1000, 100000) for _ in range(41)]  # unique: no prefix-cache hit
    before = metrics(base_url)
    assert _complete(base_url, prompt=prompt, max_tokens=5).status_code == 200
    after = metrics(base_url)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 41
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:e2e_request_latency_seconds_count"] - \
        before["vllm:e2e_request_latency_seconds_count"] == 1



@pytest.mark.slow
def test_overload_is_an_openai_503_with_retry_after(base_url: str) -> None:
    total = MAX_ONGOING + MAX_QUEUED + 8

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH,
                                     limits=httpx.Limits(max_connections=total)) as c:
            body = {"prompt": "load", "max_tokens": 48, "ignore_eos": True}
            return await asyncio.gather(*(c.post(f"{base_url}/v1/completions", json=body)
                                          for _ in range(total)))

    responses = asyncio.run(go())
    refused = [r for r in responses if r.status_code == 503]
    assert {r.status_code for r in responses} == {200, 503}
    assert len(responses) - len(refused) >= MAX_ONGOING + MAX_QUEUED, \
        [(r.status_code, r.headers.get("server"), r.text[:200]) for r in refused]
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "service_unavailable"
        assert f"{MAX_ONGOING} running and {MAX_QUEUED} queued" in r.json()["error"]["message"]
    idle = wait_idle(base_url, timeout_s=10.0)
    assert idle["vllm:num_requests_running"] == 0


@pytest.mark.slow
def test_disconnect_mid_stream_aborts_and_frees_blocks(base_url: str) -> None:
    check_disconnect_mid_stream_aborts(base_url, AUTH)


@pytest.mark.slow
def test_a_dead_worker_fails_health_until_the_replica_serves_again(base_url: str) -> None:
    # Last in the module: it kills rank 1 of the only replica, which is also the HTTP server.
    import os
    import signal

    from ray._private.state import actors  # the GCS's table; the state API needs a dashboard

    alive = actors(actor_state_name="ALIVE").values()
    replica = [a for a in alive if "LLMServer" in a["ActorClassName"]]
    assert len(replica) == 1, [a["ActorClassName"] for a in alive]
    workers = [a for a in alive if a["ActorClassName"] == "RayWorker"
               and a["OwnerAddress"]["Port"] == replica[0]["Address"]["Port"]]
    assert len(workers) == 2
    os.kill(workers[-1]["Pid"], signal.SIGKILL)
    deadline = time.monotonic() + 15
    while (health := httpx.get(f"{base_url}/health", timeout=30)).status_code == 200:
        assert time.monotonic() < deadline, "/health stayed 200 after a worker died"
        time.sleep(0.2)
    assert health.status_code == 503
    assert "engine is not healthy" in health.json()["error"]["message"]
    deadline = time.monotonic() + 120
    while True:  # the engine's new ranks, or Serve's new replica, serve again
        try:
            if httpx.get(f"{base_url}/health", timeout=30).status_code == 200:
                break
        except httpx.TransportError:  # (between an old replica and a new one)
            pass
        assert time.monotonic() < deadline, "the replica did not serve again"
        time.sleep(1.0)
    back = _complete(base_url, prompt="back", max_tokens=3)
    assert back.status_code == 200 and back.json()["usage"]["completion_tokens"] == 3
