"""Direct streaming with two replicas (tp 1 each, the model in the replica): HAProxy, or Serve's
proxy where the session has no HAProxy, spreads concurrent requests over both replicas, each
answering from its own engine with the same greedy text; an adapter of `lora_modules` is served
by each."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from serve_apps import serve_app

pytestmark = pytest.mark.slow

ARGS = {"model": "qwen3-tiny", "tensor_parallel_size": 1, "device": "cpu",
        "executor": "inprocess", "direct_streaming": True, "num_replicas": 2,
        "replica_num_cpus": 0.4, "swap_space": 0.1, "max_num_seqs": 16, "enable_lora": True,
        "lora_modules": [{"name": "tiny-lora", "path": "qwen3-tiny-lora"}]}


@pytest.fixture(scope="module")
def base_url(ray_cluster: None) -> Iterator[str]:
    with serve_app(ARGS, "qwen3-direct-2") as url:
        yield url


def test_concurrent_requests_reach_both_replicas_with_the_same_greedy_text(base_url: str) -> None:
    from ray import serve

    deployment = serve.status().applications["qwen3-direct-2"].deployments
    assert list(deployment) == ["LLMServer"]
    assert deployment["LLMServer"].replica_states == {"RUNNING": 2}

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": "qwen3-tiny", "prompt": "The capital of France is",
                    "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(c.post(f"{base_url}/v1/completions", json=body)
                                          for _ in range(8)))

    # The front learns of each replica as it starts (HAProxy reloads its backend list): a
    # batch sent at once right after the app is ready may still find one replica only.
    deadline = time.monotonic() + 30
    while True:
        responses = asyncio.run(go())
        assert [r.status_code for r in responses] == [200] * 8
        assert len({r.json()["choices"][0]["text"] for r in responses}) == 1
        replicas = {r.headers["x-replica-id"] for r in responses}
        if len(replicas) == 2:
            break
        assert time.monotonic() < deadline, f"8 requests at once all went to {replicas}"
        time.sleep(1.0)


def test_an_adapter_of_lora_modules_is_served_by_every_replica(base_url: str) -> None:
    def complete(model: str) -> httpx.Response:
        return httpx.post(f"{base_url}/v1/completions", timeout=120, json={
            "model": model, "prompt": "The capital of France is", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True})

    models = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("qwen3-tiny", None),
                                                      ("tiny-lora", "qwen3-tiny")]
    base = complete("qwen3-tiny").json()["choices"][0]["text"]
    seen: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while len(seen) < 2:  # (leastconn with one request at a time: any replica, so ask again)
        resp = complete("tiny-lora")
        assert resp.status_code == 200, resp.text
        seen[resp.headers["x-replica-id"]] = resp.json()["choices"][0]["text"]
        assert time.monotonic() < deadline, f"every adapter request went to {set(seen)}"
    assert len(set(seen.values())) == 1 and base not in seen.values()
