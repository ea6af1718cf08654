"""Block-bookkeeping cost of KVCacheManager on a replayed serving trace (no model, no torch).

Trace (seed fixed): 256 concurrent requests, prompts uniform 100-1024 tokens, half of them
starting with one shared 256-token system prompt, outputs uniform 100-1024 tokens, block
size 16, token ids uniform in [100, 150000). A finished request is freed and replaced by the
next one until --requests have been admitted.

Reports:
  decode step   us per step of append_slot(seq, tokens) (= allocate_slots(seq, tokens, 1), the
                call the scheduler makes) for every running request
  admission     us per new request: lookup_prefix + allocate_slots of its whole prompt, given the
                prompt's block hashes, which the scheduler computes once when the request
                arrives (add_request; in the async engine that overlaps the forward pass);
                the arrival hashing is reported on its own line
  context sweep us per decode step for 256 requests at a short (113-128 tokens) and a long
                (8192-8207 tokens) context, staggered so that every step fills and opens blocks
                like a real batch does; the cost must not grow with the context. Also as one
                append_slots call for all 256 (what the scheduler's decode lane makes)
  8k prompt     us to look up and allocate an 8192-token prompt: cold (no hit) / warm (hit),
                and apart from that, to hash it on arrival

Every figure is a median of wall-clock time (time.perf_counter) and, in the `cpu` column, of
this thread's CPU time (time.thread_time), which other processes on a shared machine inflate
less (they still slow it through caches and shared cores: report the load average, printed).

Usage: python bench/kvcache_bench.py [--requests 768] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import xxhash

from kvcache import KVCacheManager, prompt_block_hashes

BLOCK_SIZE = 16
CONCURRENCY = 256
SYSTEM_LEN = 256
SHORT_CONTEXT = 112  # request i holds SHORT_CONTEXT + i % 16 tokens: at most 128 while timed
LONG_CONTEXT = 8192  # ... LONG_CONTEXT + i % 16: at least 8192


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 150000) for _ in range(n)]


def replay(num_requests: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    system = _tokens(rng, SYSTEM_LEN)
    reqs = []
    for i in range(num_requests):
        plen = rng.randint(100, 1024)
        prompt = (system + _tokens(rng, plen - SYSTEM_LEN)) if i % 2 == 0 and plen > SYSTEM_LEN else _tokens(rng, plen)
        reqs.append((prompt, rng.randint(100, 1024), _tokens(rng, 1024)))
    m = KVCacheManager(num_gpu_blocks=CONCURRENCY * 2048 // BLOCK_SIZE + 64, num_cpu_blocks=0,
                       block_size=BLOCK_SIZE)
    running: dict[int, list] = {}  # seq id -> [tokens, remaining outputs, output pool]
    admit_us: list[float] = []
    admit_cpu: list[float] = []
    hash_us: list[float] = []
    step_us: list[float] = []
    step_cpu: list[float] = []
    next_req = 0
    perf, cpu = time.perf_counter, time.thread_time

    def admit() -> None:
        nonlocal next_req
        prompt, out_len, outs = reqs[next_req]
        toks = list(prompt)
        t0 = perf()
        hashes = prompt_block_hashes(toks, BLOCK_SIZE)  # on arrival (Scheduler.add_request)
        hash_us.append((perf() - t0) * 1e6)
        c0, t0 = cpu(), perf()
        prefix = m.lookup_prefix(toks, None, hashes)
        alloc = m.allocate_slots(next_req, toks, len(toks) - len(prefix) * BLOCK_SIZE, prefix, admit=True,
                                 block_hashes=hashes)
        admit_us.append((perf() - t0) * 1e6)
        admit_cpu.append((cpu() - c0) * 1e6)
        if alloc is None:
            raise RuntimeError("benchmark pool too small")
        running[next_req] = [toks, out_len, outs]
        next_req += 1

    while next_req < min(CONCURRENCY, num_requests):
        admit()
    while running:
        for st in running.values():  # the sampled token arrives (not bookkeeping)
            st[0].append(st[2][st[1] % 1024])
        items = list(running.items())
        c0, t0 = cpu(), perf()
        append_slot = m.append_slot
        for sid, st in items:
            append_slot(sid, st[0])
        step_us.append((perf() - t0) * 1e6)
        step_cpu.append((cpu() - c0) * 1e6)
        for sid, st in items:
            st[1] -= 1
            if st[1] == 0:
                m.free(sid)
                del running[sid]
                if next_req < num_requests:
                    admit()
    m.check_invariants()
    s = m.stats()
    full = step_us
    return {
        "decode_step_us_median": statistics.median(full),
        "decode_step_cpu_us_median": statistics.median(step_cpu),
        "decode_step_us_p99": sorted(full)[int(0.99 * (len(full) - 1))],
        "decode_steps": len(full),
        "admission_us_median": statistics.median(admit_us),
        "admission_cpu_us_median": statistics.median(admit_cpu),
        "admission_us_p99": sorted(admit_us)[int(0.99 * (len(admit_us) - 1))],
        "arrival_hash_us_median": statistics.median(hash_us),
        "prefix_hit_rate": s.prefix_hits / max(s.prefix_queries, 1),
    }


def context_sweep(context: int, steps: int, seed: int, bulk: bool = False) -> tuple[float, float]:
    """Median (wall, cpu) us per decode step for 256 requests; request i already holds
    context + i % block_size tokens, so each step fills 1/16 of the blocks and opens 1/16.
    With bulk, the step is one append_slots call for all of them (the scheduler's decode lane)."""
    rng = random.Random(seed)
    m = KVCacheManager(num_gpu_blocks=CONCURRENCY * ((context + steps) // BLOCK_SIZE + 3), num_cpu_blocks=0,
                       block_size=BLOCK_SIZE)
    toks = {}
    for sid in range(CONCURRENCY):
        n = context + sid % BLOCK_SIZE
        toks[sid] = _tokens(rng, n)
        m.allocate_slots(sid, toks[sid], n)
    times, cpus = [], []
    perf, cpu = time.perf_counter, time.thread_time
    for _ in range(steps):
        for t in toks.values():
            t.append(rng.randrange(100, 150000))
        items = list(toks.items())
        sids, lists = list(toks), list(toks.values())
        c0, t0 = cpu(), perf()
        if bulk:
            assert m.append_slots(sids, lists, 0, {}) == CONCURRENCY
        else:
            append_slot = m.append_slot
            for sid, t in items:
                append_slot(sid, t)
        times.append((perf() - t0) * 1e6)
        cpus.append((cpu() - c0) * 1e6)
    m.check_invariants()
    return statistics.median(times), statistics.median(cpus)


def prompt_8k(seed: int, repeats: int) -> dict[str, float]:
    """An 8192-token prompt: hashed on arrival, then looked up and allocated (the scheduling
    step's share), cold and again as a full hit."""
    rng = random.Random(seed)
    res: dict[str, list[float]] = {k: [] for k in ("hash", "cold", "cold_cpu", "warm", "warm_cpu")}
    perf, cpu = time.perf_counter, time.thread_time
    for _ in range(repeats * 4):
        m = KVCacheManager(num_gpu_blocks=2048, num_cpu_blocks=0, block_size=BLOCK_SIZE)
        for sid, prompt in enumerate((_tokens(rng, 8192),) * 2):
            prompt = list(prompt)  # the hit run gets the same tokens in a new list
            t0 = perf()
            hashes = prompt_block_hashes(prompt, BLOCK_SIZE)
            res["hash"].append((perf() - t0) * 1e6)
            c0, t0 = cpu(), perf()
            prefix = m.lookup_prefix(prompt, None, hashes)
            m.allocate_slots(sid, prompt, len(prompt) - len(prefix) * BLOCK_SIZE, prefix, block_hashes=hashes)
            key = "warm" if sid else "cold"
            res[key].append((perf() - t0) * 1e6)
            res[key + "_cpu"].append((cpu() - c0) * 1e6)
            assert len(prefix) == (511 if sid else 0)
            m.free(sid)
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "prompt8k_hash_us": med["hash"],
        "prompt8k_cold_us": med["cold"], "prompt8k_cold_cpu_us": med["cold_cpu"],
        "prompt8k_warm_us": med["warm"], "prompt8k_warm_cpu_us": med["warm_cpu"],
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()

    load_before = os.getloadavg()
    runs = [replay(args.requests, args.seed) for _ in range(args.repeats)]
    res = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    for name, ctx in (("short", SHORT_CONTEXT), ("long", LONG_CONTEXT)):
        sweeps = [context_sweep(ctx, 64, args.seed) for _ in range(args.repeats)]
        res[f"sweep_{name}_context"] = [ctx, ctx + BLOCK_SIZE - 1]
        res[f"sweep_{name}_us"] = statistics.median(w for w, _ in sweeps)
        res[f"sweep_{name}_cpu_us"] = statistics.median(c for _, c in sweeps)
        sweeps = [context_sweep(ctx, 64, args.seed, bulk=True) for _ in range(args.repeats)]
        res[f"sweep_{name}_bulk_us"] = statistics.median(w for w, _ in sweeps)
        res[f"sweep_{name}_bulk_cpu_us"] = statistics.median(c for _, c in sweeps)
    res.update(prompt_8k(args.seed, args.repeats))

    short, long_ = "sweep_short", "sweep_long"
    rows = [
        ("decode step, 256 running (median)", res["decode_step_us_median"], res["decode_step_cpu_us_median"], 200),
        ("decode step, 256 running (p99)", res["decode_step_us_p99"], None, None),
        ("admission lookup+allocate (median)", res["admission_us_median"], res["admission_cpu_us_median"], None),
        ("admission lookup+allocate (p99)", res["admission_us_p99"], None, None),
        (f"decode step, 256 x {SHORT_CONTEXT}-{SHORT_CONTEXT + BLOCK_SIZE - 1} ctx",
         res[f"{short}_us"], res[f"{short}_cpu_us"], 200),
        (f"decode step, 256 x {LONG_CONTEXT}-{LONG_CONTEXT + BLOCK_SIZE - 1} ctx",
         res[f"{long_}_us"], res[f"{long_}_cpu_us"], 200),
        (f"  the same, {SHORT_CONTEXT}-{SHORT_CONTEXT + BLOCK_SIZE - 1} ctx, append_slots",
         res[f"{short}_bulk_us"], res[f"{short}_bulk_cpu_us"], None),
        (f"  the same, {LONG_CONTEXT}-{LONG_CONTEXT + BLOCK_SIZE - 1} ctx, append_slots",
         res[f"{long_}_bulk_us"], res[f"{long_}_bulk_cpu_us"], None),
        ("arrival hashing, replay prompt (median)", res["arrival_hash_us_median"], None, None),
        ("8k prompt lookup+allocate, cold", res["prompt8k_cold_us"], res["prompt8k_cold_cpu_us"], 300),
        ("8k prompt lookup+allocate, full hit", res["prompt8k_warm_us"], res["prompt8k_warm_cpu_us"], 300),
        ("8k prompt hashing on arrival", res["prompt8k_hash_us"], None, None),
        ("8k prompt hashing + lookup+allocate, cold", res["prompt8k_hash_us"] + res["prompt8k_cold_us"],
         None, None),
    ]
    print(f"{'metric':42s} {'us':>10s} {'cpu us':>10s} {'target':>8s}")
    for name, val, cpu_val, target in rows:
        cpu_col = f"{cpu_val:10.1f}" if cpu_val is not None else f"{'':10s}"
        print(f"{name:42s} {val:10.1f} {cpu_col} {('<= ' + str(target)) if target else '':>8s}")
    print(f"decode steps per replay: {res['decode_steps']:.0f}; prefix hit rate: {res['prefix_hit_rate']:.3f}")
    load_after = os.getloadavg()
    print(f"load average (1/5/15 min) before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} on {os.cpu_count()} cpus; "
          f"{_cpu_model()}")
    res["machine"] = {"cpu": _cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
                      "xxhash": xxhash.VERSION, "loadavg_before": load_before, "loadavg_after": load_after}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
