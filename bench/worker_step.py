"""Worker step times on qwen3-tiny (fp32, CPU by default): prefill throughput and decode latency.

Drives `workers.Worker` directly with hand-built StepPlans (no scheduler): B sequences of a
fixed context, each with a contiguous block table. Token ids are drawn from [100, 150000)
with a fixed seed. Prints a table of medians; `--json PATH` writes the rows.

    .venv/bin/python bench/worker_step.py --device cpu --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from scheduler.plan import NewSeq, StepPlan
from scheduler.sampling_params import SamplingParams
from workers.config import WorkerConfig
from workers.tiny_model import resolve_model
from workers.worker import Worker

BLOCK = 16


def _plan(step: int, seqs: range, qlen: int, start: int, rng: np.random.Generator,
          new: list[NewSeq] | None = None, drop: list[int] | None = None) -> StepPlan:
    b = len(seqs)
    return StepPlan(step, np.array(seqs, np.int64), np.full(b, qlen, np.int32),
                    np.full(b, start, np.int32), rng.integers(100, 150000, b * qlen),
                    np.ones(b, bool), new_seqs=new or [], dropped_seq_ids=drop or [])


def run_case(worker: Worker, batch: int, context: int, steps: int, rng: np.random.Generator,
             sync) -> dict:
    blocks_per_seq = -(-(context + steps + 1) // BLOCK)
    params = SamplingParams(temperature=0)
    seqs = range(batch)
    new = [NewSeq(i, f"r{i}", 0, context, [], list(range(i * blocks_per_seq,
                                                         (i + 1) * blocks_per_seq)), params)
           for i in seqs]
    t = time.perf_counter()
    worker.execute(_plan(0, seqs, context, 0, rng, new))
    sync()
    prefill_s = time.perf_counter() - t
    times = []
    for k in range(steps):
        t = time.perf_counter()
        worker.execute(_plan(k + 1, seqs, 1, context + k, rng))
        sync()
        times.append(time.perf_counter() - t)
    worker.execute(StepPlan(-1, np.zeros(0, np.int64), np.zeros(0, np.int32),
                            np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, bool),
                            dropped_seq_ids=list(seqs)))
    decode = statistics.median(times)
    return {"batch": batch, "context": context, "prefill_tokens": batch * context,
            "prefill_s": prefill_s, "prefill_tok_per_s": batch * context / prefill_s,
            "decode_step_ms": decode * 1e3, "decode_tok_per_s": batch / decode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: default)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * -(-(args.context + args.steps + 1) // BLOCK)
    worker = Worker(WorkerConfig(model=resolve_model(args.model), device=args.device,
                                 dtype=args.dtype, max_model_len=max(512, args.context + 64),
                                 max_num_seqs=max(batches), num_gpu_blocks_override=blocks,
                                 swap_space=0.01, enforce_eager=args.enforce_eager))
    worker.init_distributed()
    worker.load_model()
    worker.init_cache(*worker.determine_num_blocks())
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    run_case(worker, 1, 16, 2, rng, sync)  # warm-up
    rows = [run_case(worker, b, args.context, args.steps, rng, sync) for b in batches]
    print(f"{'batch':>5} {'context':>7} {'prefill tok/s':>14} {'decode ms/step':>15} "
          f"{'decode tok/s':>13}")
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>7} {r['prefill_tok_per_s']:>14.0f} "
              f"{r['decode_step_ms']:>15.2f} {r['decode_tok_per_s']:>13.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "rows": rows}, f, indent=2)
    worker.shutdown()


if __name__ == "__main__":
    main()
