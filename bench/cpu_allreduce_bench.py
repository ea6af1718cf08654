"""The CPU tensor-parallel collectives: gloo against the shared-memory path (issue #43).

    python bench/cpu_allreduce_bench.py [--rounds 15] [--iters 200] [--json out.json]
    python bench/cpu_allreduce_bench.py --engine [--pairs 3] [--steps 60] [--json out.json]

Default: two spawned ranks of a `TensorParallelGroup` (one torch thread each); per round and
shape, `--iters` gloo all-reduces, then as many through the group's shared-memory segment
(workers/shm_collectives.py), the order swapped every round so the machine's load hits both
alike; the table is the median over rounds of the mean microseconds per collective. Shapes:
qwen3-tiny's all-reduces ([1,128], [64,128], [512,128]) and [8,1024], and the tp-2 LM-head
gather of 1 and 8 fp32 rows (75,968 logits each).

`--engine`: an offline `LLM("qwen3-tiny", tensor_parallel_size=2, executor="ray",
worker_num_cpus=0.5, device="cpu")`, each run in a fresh process (its own Ray) with
`QWEN3_SERVE_CPU_SHM_ALLREDUCE` 1 or 0, the two interleaved, `--pairs` pairs; each run times
`--steps` decode steps at batch 1 and at batch 8 (16-token prompts, greedy, ignore_eos) after
their prefill, and reports the median and min step in ms with the 1-minute load average.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ALL_REDUCE_SHAPES = ((1, 128), (64, 128), (512, 128), (8, 1024))
GATHER_SHAPES = ((1, 75968), (8, 75968))


def _rank(rank: int, port: int, rounds: int, iters: int, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from workers.distributed import TensorParallelGroup

    torch.set_num_threads(1)
    tp = TensorParallelGroup.initialize(2, rank, f"tcp://127.0.0.1:{port}", "cpu")
    assert tp.shm is not None, "the shared-memory path is off (QWEN3_SERVE_CPU_SHM_ALLREDUCE?)"
    shm = tp.shm

    def gloo_gather(x: torch.Tensor) -> None:
        parts = [torch.empty_like(x) for _ in range(2)] if rank == 0 else None
        dist.gather(x, parts, group_dst=0)

    cases = [(f"all_reduce {list(s)}", s, lambda x: dist.all_reduce(x), shm.all_reduce)
             for s in ALL_REDUCE_SHAPES]
    cases += [(f"gather {list(s)}", s, gloo_gather, shm.gather_last_dim) for s in GATHER_SHAPES]
    table: dict[str, dict[str, list[float]]] = {}
    for name, shape, gloo, ours in cases:
        x = torch.randn(shape)
        times = table.setdefault(name, {"gloo": [], "shm": []})
        for r in range(rounds):
            order = [("gloo", gloo), ("shm", ours)]
            for label, fn in order if r % 2 == 0 else order[::-1]:
                tp.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    fn(x)
                times[label].append((time.perf_counter() - start) / iters * 1e6)
    if rank == 0:
        results.put({k: {lab: statistics.median(v) for lab, v in t.items()}
                     for k, t in table.items()})
    tp.barrier()
    tp.destroy()


def micro(rounds: int, iters: int) -> dict:
    from workers.distributed import get_free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = get_free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, rounds, iters, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    out = results.get(timeout=1800)
    for p in procs:
        p.join()
    print("| collective (fp32, 2 ranks) | gloo us | shm us | gloo / shm |")
    print("|---|---|---|---|")
    for name, t in out.items():
        print(f"| {name} | {t['gloo']:.1f} | {t['shm']:.1f} | {t['gloo'] / t['shm']:.1f}x |")
    return out


def engine_run(steps: int) -> dict:
    """One tp-2 engine in this process: median and min decode step (ms) at batch 1 and 8
    (bench/tp_step.py's run, which also reports each process's CPU time per step)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from tp_step import run

    return run(2, steps)


def engine(pairs: int, steps: int) -> list[dict]:
    rows = []
    for pair in range(pairs):
        for knob in ("1", "0") if pair % 2 == 0 else ("0", "1"):
            env = {**os.environ, "QWEN3_SERVE_CPU_SHM_ALLREDUCE": knob, "RAY_AUTH_MODE": "disabled",
                   "HF_HUB_OFFLINE": "1",
                   "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            load = os.getloadavg()[0]
            proc = subprocess.run([sys.executable, __file__, "--engine-run", "--steps", str(steps)],
                                  env=env, capture_output=True, text=True, check=True)
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"pair": pair, "shm": knob == "1", "load": load, **result})
            print(json.dumps(rows[-1]), flush=True)
    print("| pair | path | load (1 min) | batch 1 median / min ms | batch 8 median / min ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        b1, b8 = r["batch 1"], r["batch 8"]
        print(f"| {r['pair']} | {'shm' if r['shm'] else 'gloo'} | {r['load']:.1f} | "
              f"{b1['median_ms']:.1f} / {b1['min_ms']:.1f} | {b8['median_ms']:.1f} / {b8['min_ms']:.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--engine", action="store_true", help="the tp-2 decode loop, shm on/off")
    parser.add_argument("--engine-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.engine_run:
        print(json.dumps(engine_run(args.steps)))
        return
    out = engine(args.pairs, args.steps) if args.engine else micro(args.rounds, args.iters)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
