"""Block-bookkeeping cost of KVCacheManager on a replayed serving trace (no model, no torch).

Trace (seed fixed): 256 concurrent requests, prompts uniform 100-1024 tokens, half of them
starting with one shared 256-token system prompt, outputs uniform 100-1024 tokens, block
size 16, token ids uniform in [100, 150000). A finished request is freed and replaced by the
next one until --requests have been admitted.

Reports:
  decode step   us per step of allocate_slots(seq, tokens, 1) for every running request (the
                call the scheduler makes for a sequence outside its decode lane)
  admission     us per new request: lookup_prefix + allocate_slots of its whole prompt, given the
                prompt's block hashes, which the scheduler computes once when the request
                arrives (add_request; in the async engine that overlaps the forward pass);
                the arrival hashing is reported on its own line
  context sweep us per decode step for 256 requests at a short (113-128 tokens) and a long
                (8192-8207 tokens) context, staggered so that every step fills and opens blocks
                like a real batch does; the cost must not grow with the context. Also as one
                allocate_decode_slots call for all 256 (what the scheduler's decode lane makes)
  8k prompt     us to look up and allocate an 8192-token prompt: cold (no hit) / warm (hit),
                and apart from that, to hash it on arrival

Every figure is a median of wall-clock time (time.perf_counter) and, in the `cpu` column, of
this thread's CPU time (time.thread_time), which other processes on a shared machine inflate
less (they still slow it through caches and shared cores: report the load average, printed).

Usage: python bench/kvcache_bench.py [--requests 768] [--repeats 5] [--json PATH]
       python bench/kvcache_bench.py --against /path/to/other/checkout [--repeats 5]
           # this tree and another, alternating run by run in one process (the VM's speed
           # drifts by up to 2x within minutes: only runs taken side by side compare)
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

import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcache import KVCacheManager, prompt_block_hashes  # noqa: E402

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
        alloc = m.allocate_new(next_req, toks, len(toks) - len(prefix) * BLOCK_SIZE, prefix, admit=True,
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
        allocate = m.allocate_slots
        for sid, st in items:
            allocate(sid, st[0], 1)
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
    With bulk, the step is one allocate_decode_slots call for all of them (the decode lane)."""
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
            assert m.allocate_decode_slots(sids, lists, 0, {}) == CONCURRENCY
        else:
            allocate = m.allocate_slots
            for sid, t in items:
                allocate(sid, t, 1)
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
            m.allocate_new(sid, prompt, len(prompt) - len(prefix) * BLOCK_SIZE, prefix, block_hashes=hashes)
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


def measure(bench, requests: int, repeats: int, seed: int) -> dict:
    """Every figure of one tree's benchmark module `bench` (this one, or another checkout's)."""
    runs = [bench.replay(requests, seed) for _ in range(repeats)]
    res = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    for name, ctx in (("short", SHORT_CONTEXT), ("long", LONG_CONTEXT)):
        sweeps = [bench.context_sweep(ctx, 64, seed) for _ in range(repeats)]
        res[f"sweep_{name}_context"] = [ctx, ctx + BLOCK_SIZE - 1]
        res[f"sweep_{name}_us"] = statistics.median(w for w, _ in sweeps)
        res[f"sweep_{name}_cpu_us"] = statistics.median(c for _, c in sweeps)
        sweeps = [bench.context_sweep(ctx, 64, seed, bulk=True) for _ in range(repeats)]
        res[f"sweep_{name}_bulk_us"] = statistics.median(w for w, _ in sweeps)
        res[f"sweep_{name}_bulk_cpu_us"] = statistics.median(c for _, c in sweeps)
    res.update(bench.prompt_8k(seed, repeats))
    return res


def rows_of(res: dict) -> list[tuple[str, str, str | None, int | None]]:
    """(metric, wall key, cpu key, target) for the table."""
    short, long_ = "sweep_short", "sweep_long"
    return [
        ("decode step, 256 running (median)", "decode_step_us_median", "decode_step_cpu_us_median", 200),
        ("decode step, 256 running (p99)", "decode_step_us_p99", None, None),
        ("admission lookup+allocate (median)", "admission_us_median", "admission_cpu_us_median", None),
        ("admission lookup+allocate (p99)", "admission_us_p99", None, None),
        (f"decode step, 256 x {SHORT_CONTEXT}-{SHORT_CONTEXT + BLOCK_SIZE - 1} ctx",
         f"{short}_us", f"{short}_cpu_us", 200),
        (f"decode step, 256 x {LONG_CONTEXT}-{LONG_CONTEXT + BLOCK_SIZE - 1} ctx",
         f"{long_}_us", f"{long_}_cpu_us", 200),
        (f"  the same, {SHORT_CONTEXT}-{SHORT_CONTEXT + BLOCK_SIZE - 1} ctx, one batch call",
         f"{short}_bulk_us", f"{short}_bulk_cpu_us", None),
        (f"  the same, {LONG_CONTEXT}-{LONG_CONTEXT + BLOCK_SIZE - 1} ctx, one batch call",
         f"{long_}_bulk_us", f"{long_}_bulk_cpu_us", None),
        ("arrival hashing, replay prompt (median)", "arrival_hash_us_median", None, None),
        ("8k prompt lookup+allocate, cold", "prompt8k_cold_us", "prompt8k_cold_cpu_us", 300),
        ("8k prompt lookup+allocate, full hit", "prompt8k_warm_us", "prompt8k_warm_cpu_us", 300),
        ("8k prompt hashing on arrival", "prompt8k_hash_us", None, None),
    ]


def compare(other_root: str, args: argparse.Namespace) -> None:
    """This tree and `other_root`, alternating which goes first, args.repeats rounds of one
    run each; medians of the rounds."""
    from against import load_bench

    trees = {"this": sys.modules[__name__], "other": load_bench(other_root, "kvcache_bench.py")}
    got: dict[str, list[dict]] = {"this": [], "other": []}
    for r in range(args.repeats):
        for name in (("this", "other") if r % 2 == 0 else ("other", "this")):
            got[name].append(measure(trees[name], args.requests, 1, args.seed + r))
    print(f"this tree vs {other_root}, {args.repeats} interleaved rounds, medians (us); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {_cpu_model()}")
    print(f"{'metric':42s} {'other':>10s} {'this':>10s}   this per round")
    for metric, key, _, _ in rows_of({}):
        med = {n: statistics.median(r[key] for r in runs) for n, runs in got.items()}
        print(f"{metric:42s} {med['other']:10.1f} {med['this']:10.1f}   "
              f"{[round(r[key]) for r in got['this']]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"against": other_root, **got}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--against", metavar="ROOT",
                    help="compare with the checkout at ROOT, run by run, in this process")
    args = ap.parse_args()
    if args.against:
        compare(args.against, args)
        return

    load_before = os.getloadavg()
    res = measure(sys.modules[__name__], args.requests, args.repeats, args.seed)
    print(f"{'metric':42s} {'us':>10s} {'cpu us':>10s} {'target':>8s}")
    for name, key, cpu_key, target in rows_of(res):
        cpu_col = f"{res[cpu_key]:10.1f}" if cpu_key is not None else f"{'':10s}"
        print(f"{name:42s} {res[key]:10.1f} {cpu_col} {('<= ' + str(target)) if target else '':>8s}")
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
