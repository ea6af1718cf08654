"""Control-plane cost of sending one StepPlan to every TP rank and getting rank 0's reply.

Compares the ways the Ray executor could do it, with no model behind the actors so only the
control plane is timed: the host channel (what `RayExecutor` uses for ranks on its host,
cluster/engine/host_channel.py: the engine writes the plan into shared memory, each rank
serves it on a thread of its own and sleeps on a futex between calls), a Ray Compiled Graph
(what it uses for ranks on other hosts), one actor call per rank with the plan inline, and
one actor call per rank after a `ray.put`. The plan is a realistic decode plan (256 sequences).
"Between calls, idle 2 ms": the same after the ranks have waited 2 ms for the next call (a
served step's ranks wait for the engine to plan it), where a graph's ranks spin on their
channel and a host channel's sleep.

    RAY_AUTH_MODE=disabled .venv/bin/python bench/ray_broadcast.py [--tp 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402

from cluster.engine.host_channel import HostChannel, RankEnd  # noqa: E402
from scheduler.plan import StepPlan, StepResult  # noqa: E402


def decode_plan(num_seqs: int) -> StepPlan:
    rng = np.random.default_rng(0)
    return StepPlan(step_id=1, seq_ids=np.arange(num_seqs, dtype=np.int64),
                    query_lens=np.ones(num_seqs, dtype=np.int32),
                    start_pos=rng.integers(100, 2000, num_seqs).astype(np.int32),
                    input_ids=rng.integers(100, 150000, num_seqs).astype(np.int64),
                    do_sample=np.ones(num_seqs, dtype=bool),
                    appended_blocks={i: [i] for i in range(0, num_seqs, 16)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import ray
    from ray.dag import InputNode, MultiOutputNode

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0.5, max_concurrency=2)
    class Rank:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def execute(self, plan: StepPlan) -> StepResult | None:
            if self.rank:
                return None
            ids = plan.seq_ids
            return StepResult(plan.step_id, ids, plan.input_ids.copy())

        def serve_channel(self, path: str, num_ranks: int) -> int:
            end = RankEnd(path, self.rank, num_ranks)
            threading.Thread(target=end.serve, args=(self.execute, self.rank == 0),
                             daemon=True).start()
            return os.getpid()

    ranks = [Rank.remote(r) for r in range(args.tp)]
    plan = decode_plan(args.seqs)
    ray.get([r.execute.remote(plan) for r in ranks])

    def time_it(fn, idle_s: float = 0.0) -> dict[str, float]:
        for _ in range(20):
            fn()
        samples = []
        for _ in range(args.iters):
            if idle_s:
                time.sleep(idle_s)
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e3)
        samples.sort()
        return {"median_ms": statistics.median(samples),
                "p90_ms": samples[int(0.9 * len(samples))]}

    def via_put() -> list:
        ref = ray.put(plan)
        return ray.get([r.execute.remote(ref) for r in ranks])

    channel = HostChannel(args.tp)
    channel.attached(ray.get([r.serve_channel.remote(channel.path, args.tp) for r in ranks]))

    def via_channel() -> list:
        return channel.read(channel.write(plan, lambda: False), lambda: False)

    rows = {
        "host channel": time_it(via_channel),
        "host channel, idle 2 ms between calls": time_it(via_channel, 0.002),
    }
    channel.close()
    rows |= {
        "actor call per rank, ray.put": time_it(via_put),
        "actor call per rank, inline": time_it(
            lambda: ray.get([r.execute.remote(plan) for r in ranks])),
    }
    with InputNode() as inp:
        dag = MultiOutputNode([r.execute.bind(inp) for r in ranks]).experimental_compile()
    rows["compiled graph"] = time_it(lambda: ray.get(dag.execute(plan)))
    rows["compiled graph, idle 2 ms between calls"] = time_it(
        lambda: ray.get(dag.execute(plan)), 0.002)
    dag.teardown()
    print(f"tp={args.tp}, decode plan of {args.seqs} sequences "
          f"({len(pickle.dumps(plan))} bytes pickled)")
    print(f"{'mechanism':42} {'median ms':>10} {'p90 ms':>8}")
    for name, r in rows.items():
        print(f"{name:42} {r['median_ms']:10.3f} {r['p90_ms']:8.3f}")
    if args.json:
        args.json.write_text(json.dumps({"tp": args.tp, "seqs": args.seqs, "rows": rows},
                                        indent=2))
    ray.shutdown()


if __name__ == "__main__":
    main()
