"""Prefill/decode disaggregation against colocated serving, over HTTP (issue 41's benchmark).

Steady decode streams run; a burst of long prompts arrives in the middle. Two apps with the
same total CPUs, one after the other on one Ray cluster:
  - colocated: two LLMServer replicas (qwen3-tiny, tp 1, in-process), `--replica-cpus` each;
  - disaggregated: one prefill and one decode replica (manifests/qwen3-pd.yaml's shape),
    `--replica-cpus` each.
Each replica's torch runs on one thread (Ray sets OMP_NUM_THREADS to its whole CPUs, at least
one). Reported per mode: the inter-token latency p50 / p99 of the steady streams while the
burst is being prefilled (every gap between two of a stream's tokens that overlaps the window
from the burst's first request to its last first token, so a stall still going on when the
window closes counts too), the
burst requests' TTFT p50, output tokens per second of the whole run, and the decode side's
KV transfers (count, MiB, mean seconds: the transfer's cost inside that TTFT).

The steady streams must outlive the window (`streams_past_window` counts those that did; a
warning says when one did not): a stream that ends inside it leaves the window's later part
unmeasured, and that is where a colocated replica's streams wait for the long prompts'
chunks. At the old 160 tokens the colocated streams, two replicas decoding four each, often
ended before the burst's last first token (0 of 8 past the window in one run of two), and
their p99 swung 31-108 ms with 26-164 samples.

The load client times tokens where it reads them, so its own pauses count as the server's: it
runs the load with its start-up heap frozen (`frozen_heap`). This process holds Ray, Serve and
the app's modules; without the freeze the burst's allocations set off a full collection of
that heap in the middle of the burst window, longer than several decode steps, and every
stream's next token waited in the client (docs/benchmarks.md, "Prefill/decode
disaggregation").

  RAY_AUTH_MODE=disabled .venv/bin/python bench/pd_bench.py --json pd.json

`--json PATH` writes {"rows": [{"mode", "itl_p99_s", "itl_p50_s", "ttft_p50_s",
"output_tok_s", ...}, ...], "args": {...}}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import random
import re
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

MODES = ("colocated", "disaggregated")
BASE = {"model": "qwen3-tiny", "tensor_parallel_size": 1, "device": "cpu",
        "executor": "inprocess", "swap_space": 0.25, "ingress_num_cpus": 0.1,
        "max_ongoing_requests": 128, "max_queued_requests": 256}


@dataclass
class Stream:
    """One request's token arrival times (perf_counter), after its start."""

    start: float
    arrivals: list[float] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated of " + str(MODES))
    p.add_argument("--streams", type=int, default=8, help="steady decode streams")
    p.add_argument("--stream-prompt", type=int, default=64, help="tokens of a stream's prompt")
    p.add_argument("--stream-tokens", type=int, default=400,
                   help="tokens each stream generates (enough to outlive the burst window)")
    p.add_argument("--burst", type=int, default=8, help="long prompts in the burst")
    p.add_argument("--burst-prompt", type=int, default=1536, help="tokens of a burst prompt")
    p.add_argument("--burst-tokens", type=int, default=16, help="tokens each burst request generates")
    p.add_argument("--burst-at", type=float, default=2.0, help="seconds after the streams start")
    p.add_argument("--replica-cpus", type=float, default=0.8, help="CPUs of each LLMServer replica")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="every replica's token budget per step (the CPU manifests' 512: chunked "
                        "prefill, so a colocated replica's streams wait one chunk, not a prompt)")
    p.add_argument("--prefill-nice", type=int, default=10,
                   help="the prefill role's cpu_nice (manifests/qwen3-pd.yaml's 10; 0: the same "
                        "CPU priority as the decode role)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8431)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    bad = set(args.modes.split(",")) - set(MODES)
    if bad:
        p.error(f"--modes: unknown {sorted(bad)}; choose from {list(MODES)}")
    return args


def app_args(mode: str, replica_cpus: float, batched_tokens: int = 512,
             prefill_nice: int = 10) -> dict[str, Any]:
    """The manifest args of a mode (same total CPUs and step budget in both)."""
    base = {**BASE, "replica_num_cpus": replica_cpus, "max_num_batched_tokens": batched_tokens}
    if mode == "colocated":
        return {**base, "num_replicas": 2}
    return {**base, "pd": {"prefill": {"num_replicas": 1, "cpu_nice": prefill_nice},
                           "decode": {"num_replicas": 1}}}


def prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, 150000) for _ in range(length)] for _ in range(n)]


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
                 ) -> Stream:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    out = Stream(time.perf_counter())
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:]).get("choices"):
                    out.arrivals.append(time.perf_counter())
    if len(out.arrivals) != max_tokens:
        raise RuntimeError(f"a stream got {len(out.arrivals)} of {max_tokens} tokens")
    return out


async def run_load(url: str, args: argparse.Namespace) -> tuple[list[Stream], list[Stream], float]:
    rng = random.Random(args.seed)
    steady, burst = (prompts(args.streams, args.stream_prompt, rng),
                     prompts(args.burst, args.burst_prompt, rng))
    limits = httpx.Limits(max_connections=args.streams + args.burst + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        streams = [asyncio.create_task(stream(client, url, p, args.stream_tokens))
                   for p in steady]
        await asyncio.sleep(args.burst_at)
        bursts = [asyncio.create_task(stream(client, url, p, args.burst_tokens)) for p in burst]
        done_streams = await asyncio.gather(*streams)
        done_bursts = await asyncio.gather(*bursts)
    return done_streams, done_bursts, time.perf_counter() - start


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect, then move every object this process has into the collector's permanent
    generation until the block ends: a collection inside it scans only what the load made."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def summarize(mode: str, streams: list[Stream], bursts: list[Stream], wall: float
              ) -> dict[str, Any]:
    lo = min(b.start for b in bursts)
    hi = max(b.arrivals[0] for b in bursts)
    itls = [t - prev for s in streams for prev, t in zip(s.arrivals, s.arrivals[1:])
            if t >= lo and prev <= hi]
    tokens = sum(len(s.arrivals) for s in streams + bursts)
    return {"mode": mode, "itl_p99_s": pct(itls, 99), "itl_p50_s": pct(itls, 50),
            "ttft_p50_s": statistics.median(b.arrivals[0] - b.start for b in bursts),
            "output_tok_s": tokens / wall, "burst_window_s": hi - lo,
            "itl_samples": len(itls),
            "streams_past_window": sum(s.arrivals[-1] > hi for s in streams)}


def transfer_stats(metrics_text: str) -> dict[str, float]:
    """The decode side's KV transfers, from /metrics (0 for colocated serving): the series
    labelled role="decode", or the one series of a text without roles."""
    def value(name: str) -> float:
        for role in (r'[^}]*role="decode"', ""):
            m = re.search(rf"^{re.escape(name)}\{{{role}[^}}]*\}} (\S+)$", metrics_text, re.M)
            if m:
                return float(m.group(1))
        return 0.0

    count = value("qwen3_serve:kv_transfer_imports_total")
    seconds_n = value("qwen3_serve:kv_transfer_seconds_count")
    return {"transfers": count,
            "fallbacks": value("qwen3_serve:kv_transfer_fallbacks_total"),
            "transfer_mib": value("qwen3_serve:kv_transfer_bytes_in_total") / 2**20,
            "transfer_mean_s": (value("qwen3_serve:kv_transfer_seconds_sum") / seconds_n
                                if seconds_n else 0.0)}


def run_mode(mode: str, args: argparse.Namespace, url: str) -> dict[str, Any]:
    from ray import serve

    from cluster.api.serve_app import build_app

    serve.run(build_app(app_args(mode, args.replica_cpus, args.max_num_batched_tokens,
                                 args.prefill_nice)), name="pd-bench", route_prefix="/")
    try:
        warm = argparse.Namespace(**{**vars(args), "streams": 2, "burst": 2, "burst_at": 0.0,
                                     "stream_tokens": 4, "burst_tokens": 2, "seed": 999})
        asyncio.run(run_load(url, warm))  # (start-up costs out of the numbers)
        with frozen_heap():
            streams, bursts, wall = asyncio.run(run_load(url, args))
        row = summarize(mode, streams, bursts, wall)
        if row["streams_past_window"] < len(streams):
            print(f"warning: {mode}: only {row['streams_past_window']} of {len(streams)} "
                  "steady streams outlived the burst window, whose later part is unmeasured; "
                  "raise --stream-tokens", file=sys.stderr)
        row.update(transfer_stats(httpx.get(f"{url}/metrics", timeout=60).text))
        return row
    finally:
        serve.delete("pd-bench")


def main() -> None:
    args = parse_args()
    import ray
    from ray import serve

    from cluster.api.serve_env import apply_proxy_env

    apply_proxy_env()
    ray.init("local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    url = f"http://127.0.0.1:{args.port}"
    rows = [run_mode(mode, args, url) for mode in args.modes.split(",")]
    print(f"{'mode':<14} {'itl_p50_s':>9} {'itl_p99_s':>9} {'ttft_p50_s':>10} "
          f"{'output_tok_s':>12} {'transfers':>9} {'MiB':>6} {'xfer_mean_s':>11}")
    for r in rows:
        print(f"{r['mode']:<14} {r['itl_p50_s']:>9.4f} {r['itl_p99_s']:>9.4f} "
              f"{r['ttft_p50_s']:>10.3f} {r['output_tok_s']:>12.1f} {r['transfers']:>9.0f} "
              f"{r['transfer_mib']:>6.1f} {r['transfer_mean_s']:>11.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=2)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
