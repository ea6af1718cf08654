"""Batch jobs on Ray Data (cluster/batch/) against `LLM.generate` on the same rows.

The `offline-cpu` workload of BENCHMARKS.md by default (qwen3-tiny fp32, prompts of uniform
32-256 random token ids, outputs of uniform 32-128 tokens with ignore_eos, greedy; fixed seed),
run four ways, each in a fresh Ray cluster:

- `llm`: `LLM.generate` in this process (the engine built before the clock starts);
- `batch-1`: one engine replica (tp 1) as the Ray Data actor pool;
- `batch-2`: two replicas on this machine;
- `batch-2nodes`: two replicas on a simulated two-node cluster (`ray.cluster_utils.Cluster`,
  the machine's CPUs split between the nodes).

A batch job's wall time counts everything from submitting the dataset to its last row, the
engine actors' start and engine load included; `llm`'s `start_s` is what building one engine
costs (outside its wall time), the part of a batch job's wall time that more rows amortize; the
batch-1 line compares against generate alone and against build plus generate. Scaling efficiency is a two-replica run's rows/s over
twice the one-replica run's. Prints a table; `--json PATH` writes the figures.

The modes run in turn, `--rounds` times (the load on a shared machine drifts); each mode's
figure is its median run.

    python bench/batch_bench.py [--rows 64] [--batch-size 16] [--in-flight 8] [--rounds 1]
                                [--modes llm,batch-1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ENGINE = {"model": "qwen3-tiny", "max_model_len": 512}


def workload(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"id": i, "prompt_token_ids": [rng.randrange(100, 150000)
                                           for _ in range(rng.randint(32, 256))],
             "sampling_params": {"temperature": 0.0, "ignore_eos": True,
                                 "max_tokens": rng.randint(32, 128)}} for i in range(n)]


def run_llm(rows: list[dict[str, Any]]) -> dict[str, float]:
    from cluster import LLM, SamplingParams

    start = time.perf_counter()
    with LLM(**ENGINE) as llm:
        built = time.perf_counter() - start
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
        params = [SamplingParams(**r["sampling_params"]) for r in rows]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "start_s": built, "tokens": tokens}


def run_batch(rows: list[dict[str, Any]], replicas: int, engine_num_cpus: float,
              batch_size: int, in_flight: int) -> dict[str, float]:
    import ray.data

    from cluster.batch import ProcessorConfig, build_processor

    config = ProcessorConfig(engine_kwargs=ENGINE, concurrency=replicas, batch_size=batch_size,
                             max_batches_in_flight=in_flight, engine_num_cpus=engine_num_cpus,
                             apply_chat_template=False, tokenize=False)
    start = time.perf_counter()
    tokens = 0
    ds = build_processor(config)(ray.data.from_items(rows, override_num_blocks=len(rows) // batch_size))
    for row in ds.iter_rows():
        assert row["error"] is None, row["error"]
        tokens += row["num_generated_tokens"]
    return {"wall_s": time.perf_counter() - start, "tokens": tokens}


def in_cluster(mode: str, rows: list[dict[str, Any]], cpus: int, batch: tuple[int, int]
               ) -> dict[str, float]:
    import ray

    if mode == "batch-2nodes":
        from ray.cluster_utils import Cluster

        # Each node: half the machine's CPUs for its engine and one logical CPU more for Ray
        # Data's own tasks (a whole CPU: a task does not fit in two halves on two nodes);
        # Ray Data spreads the pool's actors over the nodes.
        half = max(cpus // 2, 1)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": half + 1})
        cluster.add_node(num_cpus=half + 1)
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            return run_batch(rows, 2, half, *batch)
        finally:
            ray.shutdown()
            cluster.shutdown()
    # One logical CPU beyond the machine's for Ray Data's own tasks; the engines get the
    # machine's (their torch threads: Ray sets OMP_NUM_THREADS to an actor's CPUs).
    ray.init("local", num_cpus=cpus + 1, include_dashboard=False, log_to_driver=False)
    try:
        if mode == "llm":
            return run_llm(rows)
        replicas = 1 if mode == "batch-1" else 2
        return run_batch(rows, replicas, max(cpus // replicas, 1), *batch)
    finally:
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="llm,batch-1,batch-2,batch-2nodes")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--in-flight", type=int, default=8, help="batches in flight per engine")
    p.add_argument("--rounds", type=int, default=1, help="every mode this many times, in turn")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = workload(args.rows, args.seed)
    cpus = os.cpu_count() or 2
    batch = (args.batch_size, args.in_flight)
    modes = args.modes.split(",")
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):  # the modes in turn, round after round (the load drifts)
        for mode in modes:
            runs[mode].append(in_cluster(mode, rows, cpus, batch))
    # each mode's median run by wall time
    results = {mode: sorted(r, key=lambda x: x["wall_s"])[len(r) // 2] for mode, r in runs.items()}
    for mode, r in runs.items():
        results[mode]["walls_s"] = [x["wall_s"] for x in r]
    print(f"{platform.processor() or platform.machine()}, {cpus} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; {args.rows} rows, batches of {args.batch_size}, "
          f"{args.in_flight} in flight per engine")
    print(f"{'mode':<14}{'wall s':>8}{'rows/s':>9}{'tok/s':>9}")
    for mode, r in results.items():
        r["rows_per_s"] = args.rows / r["wall_s"]
        r["tok_per_s"] = r["tokens"] / r["wall_s"]
        print(f"{mode:<14}{r['wall_s']:>8.1f}{r['rows_per_s']:>9.2f}{r['tok_per_s']:>9.1f}")
    one = results.get("batch-1")
    for mode in ("batch-2", "batch-2nodes"):
        if one and mode in results:
            eff = results[mode]["rows_per_s"] / (2 * one["rows_per_s"])
            results[mode]["scaling_efficiency"] = eff
            print(f"{mode}: scaling efficiency {eff:.2f} (rows/s over 2x batch-1's)")
    if "llm" in results and one:
        llm = results["llm"]
        job = llm["tokens"] / (llm["wall_s"] + llm["start_s"])
        llm["job_tok_per_s"] = job
        print(f"batch-1 / llm: {one['tok_per_s'] / llm['tok_per_s']:.2f}x tok/s against "
              f"generate alone, {one['tok_per_s'] / job:.2f}x against the engine's build plus "
              f"generate ({llm['start_s']:.1f} s + {llm['wall_s']:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, "cpus": cpus, "batch_size": args.batch_size,
                       "in_flight": args.in_flight, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
