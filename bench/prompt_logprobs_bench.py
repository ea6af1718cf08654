"""A loglikelihood request against a plain prefill of the same prompt, in one engine.

lm-evaluation-harness scores a multiple-choice answer with one `/v1/completions` request per
choice: `echo: true`, `logprobs: 1`, `max_tokens: 1`, i.e. SamplingParams(max_tokens=1,
logprobs=1, prompt_logprobs=1). Its cost beyond a prefill of the same prompt (max_tokens=1,
nothing else) is the LM head on every prompt position instead of the last one, and a
logsumexp / rank / top-1 over the vocabulary per position (workers/prompt_logprobs.py).

Per prompt length the two requests alternate (A B A B ..., `--repeats` each, after one of each
to warm up), each on a fresh random prompt (seeded) with prefix caching off, one request at a
time, greedy; the figures are the median wall time of each and their ratio (B / A), and the
same for this process's CPU time (the engine runs in this process: on a shared CPU host the
CPU time is the steadier figure, since other processes slow the wall clock).

    .venv/bin/python bench/prompt_logprobs_bench.py [--lengths 128,512,2048] [--repeats 5]
        [--model qwen3-tiny | --qwen3 0.6b|4b|8b] [--device cpu|cuda] [--batch-tokens 2048]
        [--json out.json]

`--qwen3 0.6b` (or `--qwen3-06b`) writes Qwen3-0.6B's config with random weights (fp32 on
CPU, bf16 on CUDA) to a temporary directory: the model whose LM head is a realistic share of
the forward pass (qwen3-tiny's 152k x 128 head is ~20x its body, so there the ratio is the
head's cost alone); `4b` and `8b` are the shapes where the head is a smaller share (~10% and
~8% of the weights), bf16 (CUDA: the GPU run's step; on CPU they need 8-16 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 150000) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="128,512,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--qwen3-06b", action="store_true")
    ap.add_argument("--qwen3", choices=["0.6b", "4b", "8b"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    from cluster import LLM, SamplingParams
    from workers.tiny_model import (
        QWEN3_0_6B_CONFIG,
        QWEN3_4B_CONFIG,
        QWEN3_8B_CONFIG,
        write_random_qwen3,
    )

    lengths = [int(x) for x in args.lengths.split(",")]
    model = args.model
    tmp = None
    shape = "0.6b" if args.qwen3_06b else args.qwen3
    if shape is not None:
        tmp = tempfile.TemporaryDirectory(prefix=f"qwen3-{shape}-")
        dtype = "float32" if shape == "0.6b" and args.device == "cpu" else "bfloat16"
        config = {"0.6b": QWEN3_0_6B_CONFIG, "4b": QWEN3_4B_CONFIG, "8b": QWEN3_8B_CONFIG}[shape]
        model = str(write_random_qwen3(Path(tmp.name) / f"qwen3-{shape}",
                                       dict(config, dtype=dtype), args.seed))
        label = f"Qwen3-{shape.upper()} config, random weights, {dtype}"
    else:
        label = model
    prefill = SamplingParams(temperature=0, max_tokens=1)
    loglik = SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1)
    rng = random.Random(args.seed)
    rows = []
    with LLM(model, device=args.device, max_num_seqs=1, enable_prefix_caching=False,
             dtype="auto" if shape in (None, "0.6b") else "bfloat16",
             max_model_len=max(lengths) + 16, max_num_batched_tokens=args.batch_tokens) as llm:
        for n in lengths:
            times: dict[str, list[float]] = {"prefill": [], "loglikelihood": []}
            cpu: dict[str, list[float]] = {"prefill": [], "loglikelihood": []}
            for rep in range(args.repeats + 1):
                for name, params in (("prefill", prefill), ("loglikelihood", loglik)):
                    prompt = {"prompt_token_ids": _prompt(rng, n)}
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    start, start_cpu = time.perf_counter(), time.process_time()
                    out = llm.generate([prompt], params, use_tqdm=False)[0]
                    seconds = time.perf_counter() - start
                    cpu_seconds = time.process_time() - start_cpu
                    assert (out.prompt_logprobs is not None) == (name == "loglikelihood")
                    if rep:  # the first of each warms up
                        times[name].append(seconds)
                        cpu[name].append(cpu_seconds)
            a, b = (statistics.median(times[k]) for k in ("prefill", "loglikelihood"))
            ca, cb = (statistics.median(cpu[k]) for k in ("prefill", "loglikelihood"))
            rows.append({"prompt_tokens": n, "prefill_ms": 1e3 * a, "loglikelihood_ms": 1e3 * b,
                         "ratio": b / a, "prefill_cpu_ms": 1e3 * ca,
                         "loglikelihood_cpu_ms": 1e3 * cb, "cpu_ratio": cb / ca})
    if tmp is not None:
        tmp.cleanup()
    machine = (torch.cuda.get_device_name() if args.device == "cuda"
               else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                    f"torch threads, load average {os.getloadavg()[0]:.1f}")
    print(f"{label} on {args.device} ({machine}); medians of {args.repeats}, "
          f"max_num_batched_tokens {args.batch_tokens}")
    print(f"{'prompt tokens':>13} {'prefill ms':>11} {'loglik ms':>10} {'ratio':>6} "
          f"{'prefill cpu ms':>15} {'loglik cpu ms':>14} {'cpu ratio':>9}")
    for r in rows:
        print(f"{r['prompt_tokens']:>13} {r['prefill_ms']:>11.1f} {r['loglikelihood_ms']:>10.1f} "
              f"{r['ratio']:>6.2f} {r['prefill_cpu_ms']:>15.1f} {r['loglikelihood_cpu_ms']:>14.1f} "
              f"{r['cpu_ratio']:>9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join(sys.argv), "model": label, "device": args.device,
            "machine": machine, "torch": torch.__version__, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
