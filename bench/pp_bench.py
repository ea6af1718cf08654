"""Pipeline parallelism against tensor parallelism on CPU: pp 2 vs tp 2 vs tp 1 (Ray executor).

One engine per layout on a local Ray cluster (qwen3-tiny or a checkpoint, fp32, gloo), one
batch of `--batch` greedy requests (prompts `--prompt` tokens, `--output` new tokens each,
ignore_eos) driven step by step; per row: output tok/s over the whole batch (prefill
included), inter-token latency p50/p99 (the gaps between a request's token arrivals), and
at pp > 1 the pipeline's bubble per stage: 1 - (seconds the stage ran its layers / wall
seconds of the batch), the fraction of wall time it waited for the other stage or the host,
and the most plans the engine had in flight at once (pp micro-batches: pp, each a 1/pp share
of the batch, so every stage has one to run; scheduler/ahead.py).

    .venv/bin/python bench/pp_bench.py [--batch 32] [--prompt 64] [--output 64]
        [--layouts tp1 tp2 pp2] [--model qwen3-tiny] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}  # name -> (tp, pp)


def _busy(worker: Any) -> float:
    """A worker actor's pipeline-stage busy seconds (workers/pipeline.py)."""
    return worker.worker.stage.busy_s


def run(layout: str, args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from cluster import LLM, SamplingParams

    tp, pp = LAYOUTS[layout]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 150000) for _ in range(args.prompt)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    with LLM(args.model, tensor_parallel_size=tp, pipeline_parallel_size=pp, executor="ray",
             device="cpu", worker_num_cpus=0.5, max_num_seqs=args.batch,
             max_model_len=args.prompt + args.output + 16, swap_space=0.01,
             enable_prefix_caching=False,
             **({"max_num_batched_tokens": args.max_num_batched_tokens}
                if args.max_num_batched_tokens else {})) as llm:
        engine = llm.engine
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
        workers = engine.executor.workers
        busy0 = ray.get([w.__ray_call__.remote(_busy) for w in workers])
        arrivals: dict[str, list[float]] = {}
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        start = time.perf_counter()
        tokens = 0
        while engine.has_unfinished():
            for out in engine.step():
                n = sum(len(c.token_ids) for c in out.outputs)
                if n:
                    tokens += n
                    arrivals.setdefault(out.request_id, []).append(time.perf_counter())
        wall = time.perf_counter() - start
        busy = [b - b0 for b, b0 in zip(ray.get([w.__ray_call__.remote(_busy) for w in workers]),
                                        busy0)]
    gaps = np.concatenate([np.diff(t) for t in arrivals.values() if len(t) > 1]) * 1e3
    row = {"layout": layout, "tp": tp, "pp": pp, "batch": args.batch, "tok_s": tokens / wall,
           "itl_p50_ms": float(np.percentile(gaps, 50)),
           "itl_p99_ms": float(np.percentile(gaps, 99)), "wall_s": wall,
           "plans_in_flight": engine.max_plans_in_flight}
    if pp > 1:  # each stage's first rank
        row["bubble"] = [round(1 - busy[s * tp] / wall, 3) for s in range(pp)]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens per step (engine default: 8192); keep a CPU step of a larger "
                         "model under Ray's 10 s compiled-graph read timeout, which takes a "
                         "longer step for a dead rank")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import ray

    ray.init("local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = [run(layout, args) for layout in args.layouts]
    print(f"# {platform.node()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print("| layout | batch | tok/s | ITL p50 ms | ITL p99 ms | bubble per stage "
          "| plans in flight |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['batch']} | {r['tok_s']:.0f} | {r['itl_p50_ms']:.1f} | "
              f"{r['itl_p99_ms']:.1f} | {r.get('bubble', '-')} | {r['plans_in_flight']} |")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
