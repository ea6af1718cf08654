"""The CPU offload tier (`kv_offloading_size`) on one replica: what it saves, and what it costs.

Two measurements, each an interleaved A/B (tier off, tier on, off, on...) of engines built
once in this process, so both sides see the same machine state:

  multiturn  C chat conversations driven closed-loop (a conversation sends its next turn when
             its answer is complete; a turn's prompt is the whole conversation so far: its own
             system prompt, every user turn and answer). The GPU pool is capped
             (num_gpu_blocks_override) at `--pool-fraction` (default 1/4) of the working set
             (every conversation's final context), so a conversation's prefix is evicted while
             the others run. Reports the prefix hit rate (GPU hits + tier hits over prompt
             tokens looked up), TTFT p50/p99 (request added -> first token) and wall time.
  copies     The tier's copies alone (CacheEngine.transfer, on the side copy stream on CUDA):
             offload and load bandwidth of `--copy-blocks` blocks of a Qwen3-8B-shaped cache
             (36 layers, 8 KV heads x 128, block 16; bf16 on CUDA, fp32 on CPU) against one
             contiguous pinned copy of the same bytes (the host-device copy rate); on CUDA
             also a matmul loop's time with those copies running beside it against alone
             (whether the forward slows while the copy stream works).
  noshare    BENCHMARKS.md's offline-cpu batch (no shared prefixes) with a pool that never
             evicts: throughput (output tokens/s of wall time), so the tier's cost when it
             has nothing to do shows.

    .venv/bin/python bench/offload_bench.py [--conversations 8] [--turns 4] [--system 1024]
        [--user 64] [--answer 8] [--pool-fraction 0.25] [--tier-gib 0.05] [--repeats 3]
        [--only multiturn|noshare|copies] [--copy-blocks 256] [--device cpu|cuda]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _conversations(a: argparse.Namespace, seed: int) -> list[list[list[int]]]:
    """Per conversation, per turn, the new user tokens (turn 0 starts with the system prompt)."""
    rng = random.Random(seed)
    return [[[rng.randrange(100, 150000) for _ in range((a.system if t == 0 else 0) + a.user)]
             for t in range(a.turns)] for _ in range(a.conversations)]


def run_multiturn(engine: Any, convs: list[list[list[int]]], answer: int, tag: str
                  ) -> dict[str, float]:
    from scheduler import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True)
    history = [list(c[0]) for c in convs]
    turn = [0] * len(convs)
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    answers: dict[str, list[int]] = {}
    before = engine.scheduler.stats()
    start = time.perf_counter()
    for c, h in enumerate(history):
        rid = f"{tag}-c{c}-t0"
        engine.add_request(rid, list(h), sp)
        added[rid] = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            rid = out.request_id
            answers.setdefault(rid, []).extend(out.outputs[0].token_ids if out.outputs else [])
            if rid not in first and answers[rid]:
                first[rid] = now
            if not out.finished:
                continue
            c = int(rid.split("-c")[1].split("-")[0])
            turn[c] += 1
            if turn[c] < len(convs[c]):
                history[c] += answers[rid] + convs[c][turn[c]]
                nxt = f"{tag}-c{c}-t{turn[c]}"
                engine.add_request(nxt, list(history[c]), sp)
                added[nxt] = time.perf_counter()
    wall = time.perf_counter() - start
    after = engine.scheduler.stats()
    queries = after.prefix_queries - before.prefix_queries
    gpu_hits = after.prefix_hits - before.prefix_hits
    tier_hits = after.external_prefix_hits - before.external_prefix_hits
    ttft = sorted(first[r] - added[r] for r in added)
    return {
        "wall_s": wall,
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "hit_rate": (gpu_hits + tier_hits) / queries if queries else 0.0,
        "gpu_hit_rate": gpu_hits / queries if queries else 0.0,
        "tier_hit_rate": tier_hits / queries if queries else 0.0,
        "blocks_offloaded": after.blocks_offloaded - before.blocks_offloaded,
        "blocks_loaded": after.blocks_loaded - before.blocks_loaded,
        "preemptions": (after.preemptions_swap + after.preemptions_recompute
                        - before.preemptions_swap - before.preemptions_recompute),
        "answers": [answers[r] for r in sorted(answers)],
    }


def run_noshare(engine: Any, seed: int) -> dict[str, float]:
    """offline-cpu: 64 requests at once, prompts 32-256, outputs 32-128, greedy, ignore_eos."""
    from scheduler import SamplingParams

    rng = random.Random(seed)
    reqs = [([rng.randrange(100, 150000) for _ in range(rng.randint(32, 256))],
             rng.randint(32, 128)) for _ in range(64)]
    start = time.perf_counter()
    for i, (p, n) in enumerate(reqs):
        engine.add_request(f"ns{seed}-{i}", p, SamplingParams(temperature=0.0, max_tokens=n,
                                                              ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    return {"wall_s": wall, "tok_s": sum(n for _, n in reqs) / wall}


def run_copies(a: argparse.Namespace) -> dict[str, float]:
    """GB/s of offload and load through CacheEngine.transfer vs one contiguous pinned copy."""
    import numpy as np
    import torch

    from workers.cache_engine import CacheEngine

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    n = a.copy_blocks
    eng = CacheEngine(36, 8, 128, 16, num_gpu_blocks=n, num_cpu_blocks=0,
                      dtype=torch.bfloat16 if cuda else torch.float32, device=dev,
                      num_offload_blocks=n)
    gib = eng.gpu_cache.numel() * eng.gpu_cache.element_size() / 2**30
    pairs = np.stack([np.arange(n), np.random.default_rng(0).permutation(n)], axis=1)
    flat_dev = eng.gpu_cache.view(-1)
    flat_host = eng.offload_cache.view(-1)

    def timed(fn: Any, repeats: int = 5) -> float:
        best = float("inf")
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best

    def offload() -> None:
        eng.transfer(offload=pairs)
        eng.wait_transfers()

    def load() -> None:
        eng.transfer(load=pairs[:, ::-1].copy())
        eng.wait_transfers()

    out = {"gib": gib, "offload_gb_s": gib / timed(offload) * 1.073741824,
           "load_gb_s": gib / timed(load) * 1.073741824,
           "d2h_gb_s": gib / timed(lambda: flat_host.copy_(flat_dev, non_blocking=True))
           * 1.073741824,
           "h2d_gb_s": gib / timed(lambda: flat_dev.copy_(flat_host, non_blocking=True))
           * 1.073741824}
    if cuda:
        x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

        def compute() -> None:
            for _ in range(50):
                x @ x

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def compute_ms(with_copies: bool) -> float:
            """The compute stream's own time for the loop (the copies, if any, beside it)."""
            torch.cuda.synchronize()
            if with_copies:
                eng.transfer(offload=pairs)
            start.record()
            compute()
            end.record()
            eng.wait_transfers()
            torch.cuda.synchronize()
            return start.elapsed_time(end)

        alone = min(compute_ms(False) for _ in range(5))
        beside = min(compute_ms(True) for _ in range(5))
        out["compute_beside_copies_over_alone"] = beside / alone
    print("copies: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()))
    return out


def _engine(a: argparse.Namespace, tier: float, **kw: Any) -> Any:
    from cluster.engine.config import EngineConfig
    from cluster.engine.llm_engine import LLMEngine

    kw.setdefault("max_model_len", 4096)
    return LLMEngine(EngineConfig(model="qwen3-tiny", device=a.device, block_size=16,
                                  kv_offloading_size=tier, async_scheduling=False, **kw))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--answer", type=int, default=8)
    ap.add_argument("--pool-fraction", type=float, default=0.25)
    ap.add_argument("--tier-gib", type=float, default=0.05)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["multiturn", "noshare", "copies"])
    ap.add_argument("--copy-blocks", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--first", choices=["off", "on"], default="off",
                    help="noshare: which engine is built first")
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch

    torch.manual_seed(0)
    report: dict[str, Any] = {"machine": {"cpu": platform.processor() or platform.machine(),
                                          "threads": torch.get_num_threads(),
                                          "torch": torch.__version__}, "args": vars(a)}
    if a.only in (None, "multiturn"):
        final = a.system + a.turns * a.user + (a.turns - 1) * a.answer
        working_set = a.conversations * -(-final // 16)
        pool = max(-(-final // 16) + 1, int(working_set * a.pool_fraction))
        print(f"multiturn: {a.conversations} conversations x {a.turns} turns, final context "
              f"{final} tokens, working set {working_set} blocks, GPU pool {pool} blocks")
        engines = {"off": _engine(a, 0.0, num_gpu_blocks_override=pool, max_num_seqs=8),
                   "on": _engine(a, a.tier_gib, num_gpu_blocks_override=pool, max_num_seqs=8)}
        rows: dict[str, list[dict]] = {"off": [], "on": []}
        for r in range(a.repeats):
            convs = _conversations(a, seed=r)  # fresh prompts per repeat: nothing left cached
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                rows[name].append(run_multiturn(engines[name], convs, a.answer, f"{name}{r}"))
            if rows["off"][-1]["answers"] != rows["on"][-1]["answers"]:
                raise SystemExit(f"repeat {r}: the tier changed the greedy answers")
        print(f"{'tier':>5} {'hit rate':>9} {'gpu':>6} {'tier':>6} {'TTFT p50 ms':>12} "
              f"{'p99 ms':>8} {'wall s':>7} {'offl':>5} {'load':>5} {'preempt':>7}")
        summary = {}
        for name, rs in rows.items():
            med = {k: statistics.median(x[k] for x in rs) for k in rs[0] if k != "answers"}
            summary[name] = med
            print(f"{name:>5} {med['hit_rate']:9.3f} {med['gpu_hit_rate']:6.3f} "
                  f"{med['tier_hit_rate']:6.3f} {med['ttft_p50_ms']:12.1f} {med['ttft_p99_ms']:8.1f} "
                  f"{med['wall_s']:7.2f} {med['blocks_offloaded']:5.0f} "
                  f"{med['blocks_loaded']:5.0f} {med['preemptions']:7.0f}")
        on, off = summary["on"], summary["off"]
        ratio = (f"x{on['hit_rate'] / off['hit_rate']:.2f}" if off["hit_rate"]
                 else f"{off['hit_rate']:.3f} -> {on['hit_rate']:.3f}")
        print(f"on/off: hit rate {ratio}, "
              f"TTFT p50 x{on['ttft_p50_ms'] / off['ttft_p50_ms']:.2f}, "
              f"wall x{on['wall_s'] / off['wall_s']:.2f}")
        report["multiturn"] = {"pool_blocks": pool, "working_set_blocks": working_set,
                               "runs": {k: [{m: v for m, v in x.items() if m != "answers"}
                                            for x in rs] for k, rs in rows.items()},
                               "median": summary}
        for e in engines.values():
            e.shutdown()
    if a.only == "copies":
        report["copies"] = run_copies(a)
    if a.only in (None, "noshare"):
        # room for every run's blocks (a run's prompts + outputs <= 64 x 24 blocks): freed
        # blocks stay cached, and a later run must still find clean ones
        big = dict(max_model_len=512, max_num_seqs=64, num_gpu_blocks_override=64 * 24 * a.repeats)
        # (built in the order --first says: the engine built second has run faster here)
        engines = {name: _engine(a, a.tier_gib if name == "on" else 0.0, **big)
                   for name in ((a.first, "on" if a.first == "off" else "off"))}
        tok: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(a.repeats):
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                tok[name].append(run_noshare(engines[name], seed=r)["tok_s"])
                stats = engines[name].scheduler.stats()
                if stats.blocks_offloaded or stats.evictions:
                    raise SystemExit("the pool evicted: this measurement wants one that never does")
        off_med, on_med = statistics.median(tok["off"]), statistics.median(tok["on"])
        # each repeat's two runs are neighbours in time: their ratio sees the least VM drift
        pairs = [on / off for on, off in zip(tok["on"], tok["off"])]
        print(f"noshare (offline-cpu, pool never evicts): tier off {off_med:.0f} tok/s, "
              f"tier on {on_med:.0f} tok/s; on/off per repeat {[round(x, 3) for x in pairs]}, "
              f"median {statistics.median(pairs):.3f} (runs off {[round(x) for x in tok['off']]}, "
              f"on {[round(x) for x in tok['on']]})")
        report["noshare"] = {"tok_s": tok, "on_over_off": statistics.median(pairs)}
        for e in engines.values():
            e.shutdown()
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
