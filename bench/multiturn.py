"""Multi-turn chat benchmark: Serve's default router against the prefix-aware one (issue 24).

Workload (fixed seeds): `--system-prompts` system prompts of `--system-tokens` token ids each,
`--conversations` conversations (conversation i uses system prompt i mod the count) of
`--turns` turns; turn t sends the system prompt, every earlier user message and answer, and a
new user message of ~`--user-tokens` ids; the answer (`--max-tokens`, greedy, ignore_eos) is
re-tokenized from its text, as a chat client resends it. A conversation waits `--think-s`
between turns; `--concurrency` conversations run at once. `--unique` gives every conversation
its own system prompt (nothing shared: the routers should then match in throughput).

For each router (`power_of_two`, Serve's default, then `prefix_aware`) it deploys
`--manifest`'s app with that `request_router` as `serve run` does (build_app on a fresh Ray
cluster, so fresh caches; free ports, no dashboard), runs the workload over HTTP through Serve's
front (streamed /v1/completions, each with its conversation's `prompt_cache_key`) and reads
/metrics. Reports the prefix-cache hit rate (hit / queried prompt
tokens), prompt tokens computed (queried - hit), TTFT p50/p99 and output tokens/s; and the
ideal hit rate: one replica with an unbounded cache, the same prompts in the same order
(simulated with the engine's block hashes; the engine computes at least a prompt's last token).

`--num-gpu-blocks N` caps each replica's KV pool (the manifest's `num_gpu_blocks_override`):
set it below what one replica needs for every system prompt and the conversations in flight,
and above half of it, and a router that ignores prefixes makes both replicas cycle all the
system prompts through a pool that holds some of them (it thrashes), while one that keeps each
system prompt on one replica fits. The best prefill ratio is then simulated with the same cap
(the ideal hit rate stays the issue's: one replica holding everything): an LRU of N blocks per replica, each prompt's blocks freed last block first
as the engine frees them, prompts one at a time (the blocks that requests in flight pin are not
modelled, so the real pool behaves as a somewhat smaller one).

  source /work/bin/wt-env; .venv/bin/python bench/multiturn.py --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cluster.api.prometheus import parse_prometheus  # noqa: E402
from kvcache.hashing import prompt_block_hashes  # noqa: E402
from workers.distributed import get_free_port  # noqa: E402

TOKEN_RANGE = (100, 150000)
ROUTERS = ("power_of_two", "prefix_aware")


def make_conversations(args: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(system prompts, per conversation its user messages), from fixed seeds."""
    rng = random.Random(24)
    n_sys = args.conversations if args.unique else args.system_prompts
    systems = [[rng.randrange(*TOKEN_RANGE) for _ in range(args.system_tokens)]
               for _ in range(n_sys)]
    users = [[[rng.randrange(*TOKEN_RANGE) for _ in range(rng.randint(
        args.user_tokens * 3 // 4, args.user_tokens * 5 // 4))] for _ in range(args.turns)]
        for _ in range(args.conversations)]
    return systems, users


class ReplicaLog:
    """Where the requests went (the X-Replica-Id header): per replica the requests served and,
    sampled every `period_s`, how many streams it had open; how many system prompts were
    served by more than one replica; the routing log of the run."""

    def __init__(self) -> None:
        self.served: dict[str, int] = {}
        self.open: dict[str, int] = {}
        self.samples: list[dict[str, int]] = []
        self.homes: dict[int, set[str]] = {}  # system prompt -> replicas that served it
        self.first: dict[int, set[str]] = {}  # system prompt -> replicas of its first turns
        self.last: dict[int, str] = {}  # conversation -> replica of its latest turn
        self.moves: list[int] = []  # the turn numbers at which a conversation changed replica

    def served_turn(self, conv: int, t: int, system: int, replica: str) -> None:
        self.homes.setdefault(system, set()).add(replica)
        if t == 0:
            self.first.setdefault(system, set()).add(replica)
        elif self.last.get(conv) != replica:
            self.moves.append(t)
        self.last[conv] = replica

    def opened(self, replica: str) -> None:
        self.served[replica] = self.served.get(replica, 0) + 1
        self.open[replica] = self.open.get(replica, 0) + 1

    def closed(self, replica: str) -> None:
        self.open[replica] -= 1

    async def sample(self, period_s: float = 0.25) -> None:
        while True:
            await asyncio.sleep(period_s)
            self.samples.append(dict(self.open))

    def summary(self) -> dict[str, Any]:
        """Requests served and mean open streams per replica, and the mean of (most - fewest)
        open streams over the samples: how unevenly the work sat; how many system prompts were
        served by both replicas, in all and already by their conversations' first turns (a
        burst split), and how many later turns went elsewhere than their conversation's
        previous turn (a spill)."""
        names = sorted(self.served)
        spread = [max(s.get(n, 0) for n in names) - min(s.get(n, 0) for n in names)
                  for s in self.samples if s] or [0]
        return {"served": {n[-8:]: self.served[n] for n in names},
                "mean_open": {n[-8:]: round(sum(s.get(n, 0) for s in self.samples)
                                            / max(1, len(self.samples)), 2) for n in names},
                "mean_open_spread": round(sum(spread) / len(spread), 2),
                "systems_on_both": sum(len(h) > 1 for h in self.homes.values()),
                "split_at_first_turn": sum(len(h) > 1 for h in self.first.values()),
                "moves": len(self.moves)}


async def turn(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
               session: str, replicas: ReplicaLog) -> tuple[float, int, str, str]:
    """(TTFT, output tokens, answer text, replica) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "prompt_cache_key": session}
    start = time.perf_counter()
    text: list = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        replica = resp.headers.get("x-replica-id", "?")
        replicas.opened(replica)
        try:
            await _read_stream(resp, start, text)
        finally:
            replicas.closed(replica)
    ttft = text.pop(0) if text else 0.0
    return ttft, len(text), "".join(text), replica


async def _read_stream(resp: httpx.Response, start: float, text: list) -> None:
    """Appends the TTFT then each chunk's text."""
    first = True
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if not chunk.get("choices"):
            continue
        if first:
            text.append(time.perf_counter() - start)
            first = False
        text.append(chunk["choices"][0]["text"])


async def run_workload(url: str, args: argparse.Namespace, tokenizer: Any, replicas: ReplicaLog
                       ) -> tuple[list[float], int, float, list[list[int]]]:
    """(TTFTs, output tokens, wall seconds, every prompt in the order it was sent)."""
    systems, users = make_conversations(args)
    ttfts: list[float] = []
    sent: list[list[int]] = []
    out_tokens = 0
    gate = asyncio.Semaphore(args.concurrency)

    async def conversation(i: int, client: httpx.AsyncClient) -> None:
        nonlocal out_tokens
        async with gate:
            history = list(systems[i % len(systems)])
            for t, user in enumerate(users[i]):
                if t:
                    await asyncio.sleep(args.think_s)
                history += user
                sent.append((i % len(systems), list(history)))
                ttft, n, answer, replica = await turn(client, url, history, args.max_tokens,
                                                      f"conv-{i}", replicas)
                replicas.served_turn(i, t, i % len(systems), replica)
                ttfts.append(ttft)
                out_tokens += n
                history += tokenizer.encode(answer, add_special_tokens=False)

    start = time.perf_counter()
    sampler = asyncio.create_task(replicas.sample())
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(conversation(i, client) for i in range(args.conversations)))
    sampler.cancel()
    return ttfts, out_tokens, time.perf_counter() - start, sent


def simulate(prompts: list[tuple[int, list[int]]], block_size: int, replicas: int,
             choose: Any, capacity: int | None = None) -> tuple[int, int]:
    """(prompt tokens computed, queried), the prompts in the order sent, each (system prompt
    index, prompt) sent to replica `choose(index)`; the engine computes at least a prompt's
    last token. Caches unbounded, or LRUs of `capacity` blocks (module docstring)."""
    caches: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(replicas)]
    hit = queried = 0
    for system, p in prompts:
        cache = caches[choose(system)]
        hashes = prompt_block_hashes(p, block_size)
        n = 0
        while n < len(hashes) and hashes[n] in cache:
            n += 1
        hit += min(n, (len(p) - 1) // block_size) * block_size
        queried += len(p)
        for h in reversed(hashes):  # freed last block first: the prefix is evicted last
            cache[h] = None
            cache.move_to_end(h)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return queried - hit, queried


def ideal_hit_rate(prompts: list[tuple[int, list[int]]], block_size: int,
                   capacity: int | None = None) -> float:
    """One replica, prompts in the order sent, its cache unbounded or capped (module
    docstring)."""
    computed, queried = simulate(prompts, block_size, 1, lambda _: 0, capacity)
    return 1 - computed / queried


def best_prefill_ratio(prompts: list[tuple[int, list[int]]], block_size: int,
                       replicas: int = 2, capacity: int | None = None) -> float:
    """Prompt tokens computed by the best a router can do on this workload (every system
    prompt's conversations on one replica, the prompts spread evenly) over those of a router
    that ignores prefixes (uniformly random, fixed seed): the floor of the prefill ratio, with
    each replica's cache unbounded or capped at `capacity` blocks."""
    rng = random.Random(0)
    best, _ = simulate(prompts, block_size, replicas, lambda system: system % replicas,
                       capacity)
    blind, _ = simulate(prompts, block_size, replicas, lambda _: rng.randrange(replicas),
                        capacity)
    return best / blind


def start_app(manifest: Path, router: str, overrides: list[str],
              num_gpu_blocks: int | None = None) -> str:
    """The manifest's app with that router, as `serve run` deploys it, on a fresh Ray cluster
    (free ports, no dashboard: other clusters share this machine)."""
    import ray
    from ray import serve

    from cluster.api.serve_app import build_app
    from cluster.api.serve_env import apply_proxy_env

    apply_proxy_env()
    args = dict(yaml.safe_load(manifest.read_text())["applications"][0]["args"])
    args["request_router"] = router
    if num_gpu_blocks is not None:
        args["num_gpu_blocks_override"] = num_gpu_blocks
    for item in overrides:  # --set key=value (YAML value), e.g. router_imbalance_abs=8
        key, _, value = item.partition("=")
        args[key] = yaml.safe_load(value)
    port = get_free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def stop_app() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def per_replica_prefill(metrics: dict[str, float]) -> dict[str, int]:
    """Prompt tokens each replica computed (queried - hit), from /metrics' replica series."""
    out: dict[str, int] = {}
    for key, value in metrics.items():
        name, _, labels = key.partition("{")
        replica = next((part.split("=", 1)[1].strip('"}') for part in labels.split(",")
                        if part.startswith("replica=")), None)
        if replica is None or name not in ("qwen3_serve:replica_prefix_cache_queries_total",
                                           "qwen3_serve:replica_prefix_cache_hits_total"):
            continue
        sign = 1 if name.endswith("queries_total") else -1
        out[replica[-8:]] = out.get(replica[-8:], 0) + sign * int(value)
    return out


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--manifest", type=Path, default=ROOT / "manifests" / "qwen3-tiny-2x.yaml")
    ap.add_argument("--system-prompts", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--think-s", type=float, default=0.5)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--unique", action="store_true", help="no shared system prompts")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a manifest arg for every run (e.g. router_imbalance_abs=8)")
    ap.add_argument("--num-gpu-blocks", type=int, metavar="N",
                    help="cap each replica's KV pool at N blocks (num_gpu_blocks_override)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from workers.tiny_model import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("qwen3-tiny"))
    block_size = yaml.safe_load(args.manifest.read_text())["applications"][0]["args"].get(
        "block_size", 16)
    rows, ideal = [], None
    for router in args.routers.split(","):
        url = start_app(args.manifest, router, args.set, args.num_gpu_blocks)
        replicas = ReplicaLog()
        try:
            ttfts, out_tokens, wall, sent = asyncio.run(
                run_workload(url, args, tokenizer, replicas))
            metrics = parse_prometheus(httpx.get(f"{url}/metrics", timeout=30).text)
        finally:
            stop_app()
        m = {k.split("{")[0]: v for k, v in metrics.items() if "replica=" not in k}
        ideal = ideal_hit_rate(sent, block_size)  # the issue's: one replica holding everything
        floor = best_prefill_ratio(sent, block_size, capacity=args.num_gpu_blocks)
        hits, queried = m["vllm:prefix_cache_hits_total"], m["vllm:prefix_cache_queries_total"]
        rows.append({"router": router, "hit_rate": round(hits / queried, 4),
                     "prefill_tokens": int(queried - hits),
                     "ttft_p50_s": round(pct(ttfts, 50), 4),
                     "ttft_p99_s": round(pct(ttfts, 99), 4),
                     "output_tok_s": round(out_tokens / wall, 1),
                     "replicas": {**replicas.summary(),
                                  "prefill_tokens": per_replica_prefill(metrics)}})
        print(rows[-1], flush=True)
    cache = (f"caches capped at {args.num_gpu_blocks} blocks" if args.num_gpu_blocks
             else "unbounded caches")
    print(f"\nideal hit rate (one replica, unbounded cache): {ideal:.4f}; best prefill ratio "
          f"(sticky by system prompt / random, simulated, {cache}): {floor:.3f}")
    print(f"{'router':<14}{'hit rate':>10}{'prefill tok':>13}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'out tok/s':>11}")
    for r in rows:
        print(f"{r['router']:<14}{r['hit_rate']:>10.3f}{r['prefill_tokens']:>13}"
              f"{r['ttft_p50_s']:>10.3f}{r['ttft_p99_s']:>10.3f}{r['output_tok_s']:>11.1f}")
    if args.json:
        args.json.write_text(json.dumps({"ideal_hit_rate": round(ideal, 4),
                                         "best_prefill_ratio": round(floor, 3), "rows": rows,
                                         "args": {k: (str(v) if isinstance(v, Path) else v)
                                                  for k, v in vars(args).items()}}, indent=1))


if __name__ == "__main__":
    main()
