"""Worker step times on qwen3-tiny (fp32, CPU by default): prefill throughput and decode latency.

Drives `workers.Worker` directly with hand-built StepPlans (no scheduler): B sequences of a
fixed context, each with a contiguous block table. Token ids are drawn from [100, 150000)
with a fixed seed. Prints a table of medians; `--json PATH` writes the rows.

    .venv/bin/python bench/worker_step.py --device cpu --threads 1

`--host-overhead` measures what a decode step costs the worker's host apart from the model's
compute: the model's forward and logits are replaced by preallocated outputs (logits over a
64-token vocabulary, so the sampler's compute is nil too), and each step is a real plan
through `Worker.launch` and
`Worker.collect`: pending input tokens (async scheduling), a block appended whenever a
sequence crosses a block boundary. Rows: `batch`, `host_us_per_step` (median wall time), its
parts, and `cpu_us_per_step` (median of the thread's CPU time over the same calls: what a
loaded machine's preemptions do not add to, so A/B runs on a shared machine compare it too).

    .venv/bin/python bench/worker_step.py --host-overhead --batches 1,32,256 --json out.json

`--anatomy` (CUDA) profiles decode steps launched ahead as the engine does (launch N+1, then
collect N) with torch.profiler: wall and GPU-kernel ms per step, the fraction of the wall
time the GPU is busy (union of kernel intervals), kernels per step, the top kernels.

    python bench/worker_step.py --device cuda --anatomy --model qwen3-0.6b-random \
        --batches 1,32,128,256 --context 1024 --json anatomy.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from scheduler.plan import PENDING_TOKEN, NewSeq, StepPlan
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


def _worker(args: argparse.Namespace, **config: object) -> Worker:
    """A tp = 1 worker of `args.model` on `args.device`, its cache sized by `config`."""
    worker = Worker(WorkerConfig(model=config.pop("model", None) or resolve_model(args.model),
                                 device=args.device, dtype=args.dtype, swap_space=0.01,
                                 quantization=args.quantization,
                                 kv_cache_dtype=args.kv_cache_dtype, **config))
    worker.init_distributed()
    worker.load_model()
    worker.init_cache(*worker.determine_num_blocks())
    return worker


def _write_json(args: argparse.Namespace, rows: list[dict], **extra: object) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "threads": torch.get_num_threads(),
                       "torch": torch.__version__, **extra, "rows": rows}, f, indent=2)


class _NoComputeHead:
    """Stands in for the LM head of an all-greedy step (`ParallelLMHead.greedy_tokens`, no
    logits sent): the argmax of preallocated logits."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[:hidden.shape[0]].argmax(-1)


class _NoCompute(torch.nn.Module):
    """Stands in for the model: the forward and the logits are preallocated slices."""

    def __init__(self, max_tokens: int, hidden: int, vocab: int, device: str) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.hidden = torch.zeros(max_tokens, hidden, device=device)
        self.logits = torch.randn(max_tokens, vocab, generator=gen).to(device)
        self.lm_head = _NoComputeHead(self.logits)

    def forward(self, input_ids, positions, attn_metadata):  # noqa: ANN001 — the model's
        return self.hidden[:input_ids.shape[0]]

    def compute_logits(self, hidden):  # noqa: ANN001
        return self.logits[:hidden.shape[0]]


def host_overhead_case(worker: Worker, batch: int, context: int, steps: int,
                       pending: bool) -> dict:
    """Median host time of a decode step of `batch` sequences with the compute stubbed out."""
    params = SamplingParams(temperature=0)
    seqs = list(range(10_000 * batch, 10_000 * batch + batch))
    first = -(-context // BLOCK)
    new = [NewSeq(s, f"r{s}", 0, context, [], list(range(i * 64, i * 64 + first)), params)
           for i, s in enumerate(seqs)]
    rng = np.random.default_rng(0)
    worker.execute(_plan(0, seqs, 1, context - 1, rng, new))
    prepare, collect, total, cpu = [], [], [], []
    for k in range(steps):
        pos = context + k
        plan = _plan(k + 1, seqs, 1, pos, rng)
        if pending:
            plan.input_ids[:] = PENDING_TOKEN
        if pos % BLOCK == 0:  # every sequence opens a block (in real batches 1/16 of them)
            plan.appended_blocks = {s: [i * 64 + pos // BLOCK] for i, s in enumerate(seqs)}
        c0, t0 = time.thread_time(), time.perf_counter()
        worker.launch(plan)
        t1 = time.perf_counter()
        worker.collect(plan.step_id)
        t2, c2 = time.perf_counter(), time.thread_time()
        prepare.append(t1 - t0)
        collect.append(t2 - t1)
        total.append(t2 - t0)
        cpu.append(c2 - c0)
    worker.execute(StepPlan(steps + 1, np.zeros(0, np.int64), np.zeros(0, np.int32),
                            np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, bool),
                            dropped_seq_ids=seqs))
    return {"batch": batch, "host_us_per_step": statistics.median(total) * 1e6,
            "launch_us": statistics.median(prepare) * 1e6,
            "collect_us": statistics.median(collect) * 1e6,
            "cpu_us_per_step": statistics.median(cpu) * 1e6, "pending_tokens": pending}


def host_overhead(args: argparse.Namespace, batches: list[int]) -> None:
    worker = _worker(args, max_model_len=64 * BLOCK, max_num_seqs=max(batches),
                     num_gpu_blocks_override=64 * max(batches), enforce_eager=True)
    mc = worker.model_config
    worker.model_runner.model = _NoCompute(max(batches) * 2 + 64, mc.hidden_size, 64,
                                           args.device)
    host_overhead_case(worker, 4, 64, 5, not args.no_pending)  # warm-up
    rows = [host_overhead_case(worker, b, 200, args.steps, not args.no_pending)
            for b in batches]
    print(f"{'batch':>5} {'host us/step':>13} {'launch us':>10} {'collect us':>11} "
          f"{'cpu us/step':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['host_us_per_step']:>13.1f} {r['launch_us']:>10.1f} "
              f"{r['collect_us']:>11.1f} {r['cpu_us_per_step']:>12.1f}")
    _write_json(args, rows)
    worker.shutdown()


def _prefill(worker: Worker, batch: int, context: int, extra: int, step: int,
             rng: np.random.Generator) -> tuple[list[int], int]:
    """B sequences of `context` tokens, prefilled in plans of <= 8192 tokens; (seqs, next step)."""
    params = SamplingParams(temperature=0)
    blocks = -(-(context + extra) // BLOCK)
    seqs = list(range(batch))
    per_plan = max(1, 8192 // context)
    for i in range(0, batch, per_plan):
        chunk = seqs[i:i + per_plan]
        new = [NewSeq(s, f"r{s}", 0, context, [], list(range(s * blocks, (s + 1) * blocks)),
                      params) for s in chunk]
        worker.execute(_plan(step, chunk, context, 0, rng, new))
        step += 1
    return seqs, step


def anatomy_case(worker: Worker, batch: int, context: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    rng = np.random.default_rng(0)
    warm = 5
    seqs, step = _prefill(worker, batch, context, warm + steps + 2, 0, rng)
    pos = context
    torch.cuda.synchronize()

    def decode(n: int) -> None:
        nonlocal step, pos
        launched = []
        for _ in range(n):
            plan = _plan(step, seqs, 1, pos, rng)
            if launched:
                plan.input_ids[:] = PENDING_TOKEN
            worker.launch(plan)
            launched.append(step)
            step, pos = step + 1, pos + 1
            if len(launched) == 2:
                worker.collect(launched.pop(0))
        for s in launched:
            worker.collect(s)

    decode(warm)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        decode(steps)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    intervals = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for a, b in intervals:
        if b > end:
            busy += b - max(a, end)
            end = b
    span = (intervals[-1][1] - intervals[0][0]) if intervals else 0.0
    totals: dict[str, list[float]] = {}
    for e in kernels:
        t = totals.setdefault(e.name[:70], [0.0, 0])
        t[0] += e.time_range.end - e.time_range.start
        t[1] += 1
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:15]
    worker.execute(StepPlan(step, np.zeros(0, np.int64), np.zeros(0, np.int32),
                            np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, bool),
                            dropped_seq_ids=seqs))
    return {"batch": batch, "context": context, "wall_ms": wall * 1e3 / steps,
            "kernel_ms": sum(b - a for a, b in intervals) / 1e3 / steps,
            "gpu_busy": busy / span if span else 0.0,
            "kernels_per_step": len(kernels) / steps,
            "top_kernels": [[name, round(us / steps, 1), n / steps] for name, (us, n) in top]}


def anatomy(args: argparse.Namespace, batches: list[int]) -> None:
    if args.device != "cuda":
        raise SystemExit("--anatomy profiles GPU kernels: pass --device cuda")
    from throughput import model_path

    extra = args.steps + 16
    blocks = max(batches) * -(-(args.context + extra) // BLOCK)
    worker = _worker(args, model=model_path(args.model), max_model_len=args.context + extra + 64,
                     max_num_seqs=max(batches), num_gpu_blocks_override=blocks,
                     max_num_batched_tokens=8192, enforce_eager=args.enforce_eager)
    rows = [anatomy_case(worker, b, args.context, args.steps) for b in batches]
    print(f"{'batch':>5} {'wall ms':>8} {'kernel ms':>10} {'GPU busy':>9} {'kernels':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['wall_ms']:>8.2f} {r['kernel_ms']:>10.2f} "
              f"{100 * r['gpu_busy']:>8.0f}% {r['kernels_per_step']:>8.0f}")
    _write_json(args, rows, gpu=torch.cuda.get_device_name(0), model=args.model)
    worker.shutdown()


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
    ap.add_argument("--quantization", default=None, choices=[None, "fp8"],
                    help="fp8: the model's linear weights quantized at load (FP8 W8A8)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--anatomy", action="store_true",
                    help="CUDA: profile decode steps (GPU busy fraction, kernels per step)")
    ap.add_argument("--host-overhead", action="store_true",
                    help="the worker's host time per decode step, compute stubbed out")
    ap.add_argument("--no-pending", action="store_true",
                    help="with --host-overhead: name every input token (no async scheduling)")
    args = ap.parse_args()
    if args.threads:  # (the environment too: a CPU worker then keeps it, workers/cpu_threads.py)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    if args.host_overhead:
        host_overhead(args, batches)
        return
    if args.anatomy:
        anatomy(args, batches)
        return
    blocks = max(batches) * -(-(args.context + args.steps + 1) // BLOCK)
    # Each phase and row is printed (and the JSON rewritten) as it ends, so a run stopped by a
    # time budget says how far it got: the GPU report's FP8 decode step once left an empty log.
    start = time.perf_counter()
    worker = _worker(args, max_model_len=max(512, args.context + 64), max_num_seqs=max(batches),
                     num_gpu_blocks_override=blocks, enforce_eager=args.enforce_eager)
    print(f"start-up (load{', quantize' if args.quantization else ''}, cache, graphs, warm-up): "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    run_case(worker, 1, 16, 2, rng, sync)  # warm-up
    print(f"{'batch':>5} {'context':>7} {'prefill tok/s':>14} {'decode ms/step':>15} "
          f"{'decode tok/s':>13}", flush=True)
    rows = []
    for b in batches:
        r = run_case(worker, b, args.context, args.steps, rng, sync)
        rows.append(r)
        print(f"{r['batch']:>5} {r['context']:>7} {r['prefill_tok_per_s']:>14.0f} "
              f"{r['decode_step_ms']:>15.2f} {r['decode_tok_per_s']:>13.0f}", flush=True)
        _write_json(args, rows, quantization=args.quantization,
                    kv_cache_dtype=args.kv_cache_dtype)
    worker.shutdown()


if __name__ == "__main__":
    main()
