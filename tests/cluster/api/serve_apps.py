"""Serve apps for the HTTP tests: one app started from a manifest's args on the shared cluster,
at a free HTTP port, and stopped with Serve after the module; an app's /metrics as numbers, and
the wait for its engine to be idle; the check that a client leaving mid-stream frees its
request's blocks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from session_ports import free_port

from cluster.api.prometheus import parse_prometheus


@contextmanager
def serve_app(args: dict[str, Any], name: str) -> Iterator[str]:
    """The app `build_app(args)` under `name` at route /; yields its base URL."""
    from ray import serve
    from ray.serve.context import _get_global_client

    from cluster.api.serve_app import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    port = _get_global_client().http_config.port  # (Serve may already run with its own)
    serve.run(build_app(args), name=name, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.delete(name)
        serve.shutdown()  # the next module starts Serve with its own HTTP port


def metrics(base_url: str) -> dict[str, float]:
    """The app's /metrics by series name, the model label left out of each."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {k.split("{")[0] + ("{" + k.split(",", 1)[1] if "," in k else ""): v
            for k, v in parse_prometheus(text).items()}


def wait_idle(base_url: str, timeout_s: float) -> dict[str, float]:
    """/metrics once no request runs and no KV block is held, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base_url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def check_disconnect_mid_stream_aborts(base_url: str, headers: dict[str, str]) -> None:
    """A client that closes a long stream after a few chunks: its request is aborted within a
    step or two, and its blocks freed."""
    body = {"model": "qwen3-tiny", "prompt": "Tell me a very long story.", "max_tokens": 3000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers,
                      timeout=30) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(not line or line.startswith("data: {") for line in got)
        busy = metrics(base_url)
        assert busy["vllm:num_requests_running"] == 1 and busy["vllm:kv_cache_usage_perc"] > 0
    idle = wait_idle(base_url, timeout_s=10.0)
    assert (idle["vllm:num_requests_running"], idle["vllm:kv_cache_usage_perc"]) == (0, 0.0)
    assert idle['vllm:request_success_total{finished_reason="abort"}'] >= 1
