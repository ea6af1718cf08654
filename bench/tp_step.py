"""A decode step of qwen3-tiny at tp 1 and tp 2 on CPU, offline: wall time and each process's
CPU time per step, for one or more source trees run alternately (an A/B of two commits).

Each run is a fresh process with its own Ray (`ray.init("local")`): one offline `LLM` (tp 1:
the in-process executor; tp 2: the Ray executor, two RayWorker actors on a compiled graph,
`worker_num_cpus` 0.5), then at batch 1 and at batch 8 (16-token prompts, greedy, ignore_eos)
four untimed steps and `--steps` timed `LLMEngine.step()` calls. Per batch it reports the
median and min step (ms) and the CPU time per step (ms) of the driver and of each rank, read
from /proc: a waiter that spins shows as CPU time that a sleeping one does not, whatever the
machine's load. The runs of one pair go tree by tree, tp by tp, in an order reversed every
pair, so that a load that drifts hits every variant alike; the 1-minute load average is
recorded per run.

    python bench/tp_step.py --trees base=/tmp/base new=. --tp 1 2 --pairs 5 --steps 100

A tree is a checkout of this project; its code runs the engine (PYTHONPATH), this script only
drives it, so the other tree needs no copy of this file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(tp: int, steps: int) -> dict:
    """One engine in this process: per batch size, the step's wall and CPU times."""
    import ray

    from cluster import LLM, SamplingParams

    ray.init("local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    kw = dict(executor="ray", worker_num_cpus=0.5) if tp > 1 else dict(executor="inprocess")
    llm = LLM("qwen3-tiny", tensor_parallel_size=tp, device="cpu", **kw)
    engine, out = llm.engine, {}
    try:
        pids = [os.getpid()]
        if tp > 1:
            pids += ray.get([w.pid.remote() for w in engine.executor.workers])
        for batch in (1, 8):
            sp = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
            for i in range(batch):
                engine.add_request(f"b{batch}-{i}", list(range(100 + i, 116 + i)), sp)
            for _ in range(4):  # the prefill and a few decodes, untimed
                engine.step()
            cpu0, times = [_cpu_s(p) for p in pids], []
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                times.append((time.perf_counter() - start) * 1e3)
            cpu = [(_cpu_s(p) - c) / steps * 1e3 for p, c in zip(pids, cpu0)]
            while engine.has_unfinished():
                engine.step()
            out[f"batch {batch}"] = {"median_ms": statistics.median(times), "min_ms": min(times),
                                     "cpu_ms_per_step": cpu}
    finally:
        llm.shutdown()
        ray.shutdown()
    return out


def compare(trees: dict[str, Path], tps: list[int], pairs: int, steps: int) -> list[dict]:
    variants = [(name, tp) for tp in tps for name in trees]
    rows = []
    for pair in range(pairs):
        for name, tp in variants if pair % 2 == 0 else variants[::-1]:
            env = {**os.environ, "PYTHONPATH": str(trees[name]), "HF_HUB_OFFLINE": "1",
                   "RAY_AUTH_MODE": "disabled", "OMP_WAIT_POLICY": "PASSIVE"}
            load = os.getloadavg()[0]
            proc = subprocess.run([sys.executable, __file__, "--run", "--tp", str(tp),
                                   "--steps", str(steps)], env=env, cwd=trees[name],
                                  capture_output=True, text=True, check=True)
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"pair": pair, "tree": name, "tp": tp, "load": load, **result})
            print(json.dumps(rows[-1]), flush=True)
    print("| pair | tree | tp | load | batch 1 median / min ms | CPU ms/step (driver, ranks) "
          "| batch 8 median / min ms | CPU ms/step (driver, ranks) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = []
        for b in ("batch 1", "batch 8"):
            x = r[b]
            cells += [f"{x['median_ms']:.1f} / {x['min_ms']:.1f}",
                      ", ".join(f"{c:.1f}" for c in x["cpu_ms_per_step"])]
        print(f"| {r['pair']} | {r['tree']} | {r['tp']} | {r['load']:.1f} | " + " | ".join(cells)
              + " |")
    return rows


def _tree(spec: str) -> tuple[str, Path]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not Path(path, "cluster").is_dir():
        raise argparse.ArgumentTypeError(f"a tree is NAME=PATH of a checkout (PATH/cluster "
                                         f"must exist); got {spec!r}")
    return name, Path(path).resolve()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", type=_tree, nargs="+", default=[("this", ROOT)],
                        help="NAME=PATH of each checkout to run (default: this one)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.steps < 1:
        parser.error("--pairs and --steps must be >= 1")
    if args.run:
        print(json.dumps(run(args.tp[0], args.steps)))
        return
    rows = compare(dict(args.trees), args.tp, args.pairs, args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
