"""Each prefill/decode role autoscales live on Serve under a scripted HTTP load
(cluster/api/pd_autoscaling.py, manifests/qwen3-pd.yaml's args with each role's
autoscaling_config): a burst of long prompts with two output tokens each scales the prefill
role to 2 while the decode role stays at 1; many concurrent long streams with short prompts
scale the decode role to 2 while the prefill role goes back to 1 (its queue is empty, so its
policy asks for the minimum); with the load gone both roles go back to 1. Every request of
the load is answered whole (200, max_tokens tokens).

The replica counts are Serve's own (`serve.status()`: every replica of the deployment that
is not stopping, read while the load runs; Ray's actor table: every replica ever started), and
the signals each policy saw are the controller's copy of the replicas' reports (its
`_get_metrics_for_deployment_for_testing`), so the test shows the stats reaching the
controller and the scaling following them, not only a replica computing them. Ray's test cluster has 4 logical CPUs on 2 real
ones: each LLMServer replica asks for 0.2 CPU, so 2 + 2 replicas and the ingress fit at once.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from serve_apps import serve_app

from cluster.api.pd_autoscaling import (
    DEFAULT_TARGETS,
    KV_CACHE_USAGE,
    QUEUED_PROMPT_TOKENS,
    RUNNING_SEQS,
)

pytestmark = pytest.mark.slow

MANIFEST = Path(__file__).resolve().parents[3] / "manifests" / "qwen3-pd.yaml"
APP = "qwen3-pd-autoscaling"
ROLES = ("prefill", "decode")
# Short delays and look-back so the test runs in a few minutes; metrics_interval_s is how
# often a replica pushes its stats to the controller (Serve's default, 10 s, would be most
# of the look-back).
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
               "upscale_delay_s": 2.0, "downscale_delay_s": 6.0,
               "look_back_period_s": 3.0, "metrics_interval_s": 0.5}
LONG_PROMPT_WORDS = 1500   # a prefill of ~1,500 tokens per request
BURST_CLIENTS = 16
STREAM_CLIENTS = 40        # > the decode policy's 32 running sequences per replica
STREAM_TOKENS = 300
# each role's policy is its default one (the roles' autoscaling_config names none)
PREFILL_TARGET = DEFAULT_TARGETS["prefill"]["target_per_replica"]
DECODE_TARGET = DEFAULT_TARGETS["decode"]["target_per_replica"]
KV_TARGET = DEFAULT_TARGETS["decode"]["kv_usage_target"]


@pytest.fixture(scope="module")
def base_url(ray_cluster: None) -> Iterator[str]:
    args = dict(yaml.safe_load(MANIFEST.read_text())["applications"][0]["args"])
    args["replica_num_cpus"] = 0.2
    args["pd"] = {role: {**{k: v for k, v in args["pd"][role].items() if k != "num_replicas"},
                         "autoscaling_config": dict(AUTOSCALING)} for role in ROLES}
    with serve_app(args, APP) as url:
        yield url


def replicas(role: str) -> int:
    """The role's replicas Serve holds (starting or running; not those stopping)."""
    from ray import serve

    states = serve.status().applications[APP].deployments[f"LLMServer-{role}"].replica_states
    return sum(n for state, n in states.items() if state not in ("STOPPING", "STOPPED"))


class Load:
    """`clients` threads sending `request(i)` in a loop until stopped; each answer's check
    result is kept (True: 200 and every token)."""

    def __init__(self, clients: int, request: Callable[[int], bool]) -> None:
        self.stop = threading.Event()
        self.results: list[bool] = []
        self._pool = ThreadPoolExecutor(clients)
        self._futures = [self._pool.submit(self._loop, request, c) for c in range(clients)]

    def _loop(self, request: Callable[[int], bool], client: int) -> None:
        i = 0
        while not self.stop.is_set():
            self.results.append(request(client * 100_000 + i))
            i += 1

    def finish(self) -> list[bool]:
        self.stop.set()
        for f in self._futures:
            f.result(timeout=300)
        self._pool.shutdown()
        return self.results


def long_prompt(base_url: str) -> Callable[[int], bool]:
    def request(i: int) -> bool:
        # a distinct first word: no prompt hits another's prefix cache
        body = {"prompt": f"{i} " + "word " * LONG_PROMPT_WORDS, "max_tokens": 2,
                "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300)
        return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    return request


def long_stream(base_url: str) -> Callable[[int], bool]:
    def request(i: int) -> bool:
        body = {"prompt": f"Story {i}:", "max_tokens": STREAM_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        usage = None
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                return False
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
        return usage is not None and usage["completion_tokens"] == STREAM_TOKENS
    return request


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until `condition()` held."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} within {timeout_s} s"
        time.sleep(0.5)
    return time.monotonic() - start


def replicas_started(role: str) -> int:
    """The role's replica actors Ray ever started for this app (dead ones too): a replica
    that came and went between two looks at serve.status() still counts."""
    from ray._private.state import actors  # the GCS's table; the state API needs a dashboard

    tag = f"{APP}#LLMServer-{role}#"
    return sum(tag in (a.get("Name") or "") for a in actors().values())


class ControllerView:
    """What Serve's controller holds of each role's replica stats, sampled every half second
    in a thread: each signal summed over the role's replicas (each replica's latest report),
    its last value and, per phase, its peak over time."""

    def __init__(self) -> None:
        from ray.serve._private.common import DeploymentID
        from ray.serve.context import _get_global_client

        self._controller = _get_global_client()._controller
        self._ids = {role: DeploymentID(name=f"LLMServer-{role}", app_name=APP)
                     for role in ROLES}
        self.phase = ""
        self.peaks: dict[tuple[str, str], dict[str, float]] = {}
        self.last: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        while not self._stop.wait(0.5):
            for role, deployment in self._ids.items():
                metrics = ray.get(
                    self._controller._get_metrics_for_deployment_for_testing.remote(deployment))
                peaks = self.peaks.setdefault((self.phase, role), {})
                for name, per_replica in metrics.items():
                    now = sum(series[-1].value for series in per_replica if series)
                    peaks[name] = max(peaks.get(name, 0.0), now)
                    self.last[role, name] = now

    def peak(self, phase: str, role: str, metric: str) -> float:
        return self.peaks.get((phase, role), {}).get(metric, 0.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_each_role_scales_on_its_own_signal(base_url: str) -> None:
    assert (replicas("prefill"), replicas("decode")) == (1, 1)
    view = ControllerView()
    try:
        # (a) a burst of long prompts: prefill's queue grows, decode's sequences stay few
        view.phase = "burst"
        burst = Load(BURST_CLIENTS, long_prompt(base_url))
        up_a = wait_for(lambda: replicas("prefill") == 2, 90, "prefill scaled to 2")
        burst_results = burst.finish()
        assert burst_results and all(burst_results), \
            f"{burst_results.count(False)} of {len(burst_results)} failed"
        assert replicas_started("decode") == 1
        # what each policy saw: prefill over its target, decode under both of its
        assert view.peak("burst", "prefill", QUEUED_PROMPT_TOKENS) > PREFILL_TARGET
        assert view.peak("burst", "decode", RUNNING_SEQS) < DECODE_TARGET
        assert view.peak("burst", "decode", KV_CACHE_USAGE) < KV_TARGET

        # (b) many long streams with short prompts: decode's running sequences grow
        view.phase = "streams"
        streams = Load(STREAM_CLIENTS, long_stream(base_url))
        up_b = wait_for(lambda: replicas("decode") == 2, 120, "decode scaled to 2")
        down_b = wait_for(lambda: replicas("prefill") == 1, 60, "prefill back to 1")
        stream_results = streams.finish()
        assert stream_results and all(stream_results), \
            f"{stream_results.count(False)} of {len(stream_results)} failed"
        assert view.peak("streams", "decode", RUNNING_SEQS) > DECODE_TARGET
        # short prompts queue little: prefill's policy asks for its minimum
        assert view.peak("streams", "prefill", QUEUED_PROMPT_TOKENS) < PREFILL_TARGET

        # (c) the load gone: both roles back to the minimum
        view.phase = "idle"
        down_c = wait_for(lambda: (replicas("prefill"), replicas("decode")) == (1, 1), 60,
                          "both roles back to 1")
        # ... because the signals they report fell to nothing
        wait_for(lambda: view.last.get(("decode", RUNNING_SEQS)) == 0
                 and view.last.get(("prefill", QUEUED_PROMPT_TOKENS)) == 0, 10,
                 "the controller holds the idle replicas' reports")
    finally:
        view.close()
    print(f"\n{len(burst_results)} long prompts: prefill at 2 {up_a:.1f} s into them; "
          f"{len(stream_results)} streams: decode at 2 {up_b:.1f} s into them, prefill at 1 "
          f"{down_b:.1f} s after; both at 1 {down_c:.1f} s after the load; the controller's "
          f"peaks: {view.peaks}")
