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
        [--layers 2,4] [--json out.json]

`--qwen3 0.6b` (or `--qwen3-06b`) writes Qwen3-0.6B's config.json and the tokenizer to a
temporary directory and runs it with `load_format: dummy` (random weights filled in place on
the device, workers/loader.py; fp32 on CPU, bf16 on CUDA; no checkpoint is written or read):
the model whose LM head is a realistic share of the forward pass (qwen3-tiny's 152k x 128 head
is ~20x its body, so there the ratio is the head's cost alone); `4b` and `8b` are the shapes
where the head is a smaller share (~10% and ~8% of the weights), bf16 (CUDA: the GPU run's
step; on CPU they need 8-16 GB). Both requests read the same weights, and what they cost does
not depend on the values, so random weights of the real shapes measure the ratio.

`--layers 2,4` (with `--qwen3 4b|8b`): full-depth 4B/8B do not fit a small shared CPU host, so
the model is built with the real hidden size, vocabulary, heads and intermediate size but each
of these layer counts L', and both requests are measured end to end at each (the reduced-depth
ratios). From them: the body's time per layer (the prefill's slope between the two depths),
the rest of a prefill (its intercept: embedding, the last row's head, scheduling), and a
loglikelihood request's extra time (its time less the prefill's, median over the depths); and,
in this process at the engine's thread count, the head's GEMM over the prompt's rows
(`head_all`, in PROMPT_LOGPROB_ROWS slices) and over the last row (`head_last`) and the
logprob passes over its logits (`passes`, sampler.token_logprobs). The full-depth ratio is an
EXTRAPOLATION to the config's L layers, printed two ways: from the engine's figures,
(rest + L*layer + extra) / (rest + L*layer), and from the components,
(L*layer + head_all + passes) / (L*layer + head_last). All times are CPU times on a CPU.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 150000) for _ in range(n)]


def _clock(device: str) -> float:
    """Seconds of this process's CPU time on a CPU (the steadier figure on a shared host, the
    engine running in this process), of wall time on CUDA."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def measure(llm: Any, lengths: list[int], repeats: int, rng: random.Random,
            device: str) -> list[dict[str, float]]:
    """Per prompt length: median wall and CPU ms of a prefill and a loglikelihood request."""
    from cluster import SamplingParams

    prefill = SamplingParams(temperature=0, max_tokens=1)
    loglik = SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1)
    rows = []
    for n in lengths:
        wall: dict[str, list[float]] = {"prefill": [], "loglikelihood": []}
        cpu: dict[str, list[float]] = {"prefill": [], "loglikelihood": []}
        for rep in range(repeats + 1):
            for name, params in (("prefill", prefill), ("loglikelihood", loglik)):
                prompt = {"prompt_token_ids": _prompt(rng, n)}
                start, start_cpu = time.perf_counter(), _clock(device)
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                cpu_seconds = _clock(device) - start_cpu
                seconds = time.perf_counter() - start
                assert (out.prompt_logprobs is not None) == (name == "loglikelihood")
                if rep:  # the first of each warms up
                    wall[name].append(seconds)
                    cpu[name].append(cpu_seconds)
        a, b = (statistics.median(wall[k]) for k in ("prefill", "loglikelihood"))
        ca, cb = (statistics.median(cpu[k]) for k in ("prefill", "loglikelihood"))
        rows.append({"prompt_tokens": n, "prefill_ms": 1e3 * a, "loglikelihood_ms": 1e3 * b,
                     "ratio": b / a, "prefill_cpu_ms": 1e3 * ca,
                     "loglikelihood_cpu_ms": 1e3 * cb, "cpu_ratio": cb / ca})
    return rows


def head_components(config: dict[str, Any], dtype: str, n: int, repeats: int,
                    device: str) -> dict[str, float]:
    """ms of the LM head's GEMM over n - 1 prompt rows in PROMPT_LOGPROB_ROWS slices
    (`head_all`, plus the last row's), over the last row alone (`head_last`), and of the
    logprob passes over those logits (`passes`), medians of `repeats` after a warm-up."""
    import torch
    import torch.nn.functional as F

    from workers.prompt_logprobs import PROMPT_LOGPROB_ROWS
    from workers.sampler import token_logprobs

    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    weight = (torch.randn(config["vocab_size"], config["hidden_size"], generator=g)
              * 0.02).to(dt).to(device)
    hidden = torch.randn(n, config["hidden_size"], generator=g).to(dt).to(device)
    targets = torch.randint(0, config["vocab_size"], (n - 1,), generator=g).to(device)
    times: dict[str, list[float]] = {"head_all": [], "head_last": [], "passes": []}
    for rep in range(repeats + 1):
        head = passes = 0.0
        for lo in range(0, n - 1, PROMPT_LOGPROB_ROWS):
            hi = min(lo + PROMPT_LOGPROB_ROWS, n - 1)
            start = _clock(device)
            logits = F.linear(hidden[lo:hi], weight)
            mid = _clock(device)
            token_logprobs(logits, targets[lo:hi], 1)
            head, passes = head + mid - start, passes + _clock(device) - mid
        start = _clock(device)
        if device == "cpu":  # (ParallelLMHead's product for a few rows on a CPU)
            torch.mm(weight, hidden[n - 1:].t()).t().contiguous()
        else:
            F.linear(hidden[n - 1:], weight)
        last = _clock(device) - start
        if rep:
            times["head_all"].append(head + last)
            times["head_last"].append(last)
            times["passes"].append(passes)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def extrapolate(config: dict[str, Any], depths: dict[int, list[dict[str, float]]],
                heads: dict[int, dict[str, float]]) -> list[dict[str, float]]:
    """Per prompt length, the full-depth figures from two reduced depths (module docstring)."""
    (l1, r1), (l2, r2) = sorted(depths.items())[:1] + sorted(depths.items())[-1:]
    full = config["num_hidden_layers"]
    rows = []
    for i, a in enumerate(r1):
        b = r2[i]
        layer = (b["prefill_cpu_ms"] - a["prefill_cpu_ms"]) / (l2 - l1)
        rest = a["prefill_cpu_ms"] - l1 * layer
        extra = statistics.median(r[i]["loglikelihood_cpu_ms"] - r[i]["prefill_cpu_ms"]
                                  for r in depths.values())
        h = heads[a["prompt_tokens"]]
        prefill_full = rest + full * layer
        rows.append({"prompt_tokens": a["prompt_tokens"], "layers": full, "layer_ms": layer,
                     "rest_ms": rest, "extra_ms": extra, **h,
                     "engine_ratio": (prefill_full + extra) / prefill_full,
                     "component_ratio": (full * layer + h["head_all"] + h["passes"])
                     / (full * layer + h["head_last"])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="128,512,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--qwen3-06b", action="store_true")
    ap.add_argument("--qwen3", choices=["0.6b", "4b", "8b"])
    ap.add_argument("--layers", help="reduced depths L' (two or more, e.g. 2,4), with --qwen3")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    from cluster import LLM
    from workers.tiny_model import (
        QWEN3_0_6B_CONFIG,
        QWEN3_4B_CONFIG,
        QWEN3_8B_CONFIG,
        write_qwen3_config,
    )

    lengths = [int(x) for x in args.lengths.split(",")]
    shape = "0.6b" if args.qwen3_06b else args.qwen3
    layers = [int(x) for x in args.layers.split(",")] if args.layers else []
    if layers and (shape is None or len(set(layers)) < 2):
        ap.error("--layers needs --qwen3 and two or more different layer counts, e.g. 2,4")
    dtype = "float32" if shape in (None, "0.6b") and args.device == "cpu" else "bfloat16"
    config: dict[str, Any] = {}
    tmp = tempfile.TemporaryDirectory(prefix=f"qwen3-{shape}-") if shape else None
    models: dict[int, str] = {0: args.model}
    if shape is not None:
        assert tmp is not None
        config = {"0.6b": QWEN3_0_6B_CONFIG, "4b": QWEN3_4B_CONFIG, "8b": QWEN3_8B_CONFIG}[shape]
        config = dict(config, dtype=dtype)
        models = {}
        for depth in layers or [0]:
            cfg = dict(config, num_hidden_layers=depth or config["num_hidden_layers"])
            models[depth] = str(write_qwen3_config(Path(tmp.name) / f"qwen3-{shape}-{depth}",
                                                   cfg))
        label = f"Qwen3-{shape.upper()} config, random weights (load_format dummy), {dtype}"
    else:
        label = args.model
    rng = random.Random(args.seed)
    depths: dict[int, list[dict[str, float]]] = {}
    heads: dict[int, dict[str, float]] = {}
    for depth, model in models.items():
        # (a --qwen3 config runs in its own dtype, random weights of its shapes: on a CPU
        # "auto" would be float32)
        with LLM(model, device=args.device, max_num_seqs=1, enable_prefix_caching=False,
                 dtype=dtype if shape else "auto", max_model_len=max(lengths) + 16,
                 max_num_batched_tokens=args.batch_tokens,
                 load_format="dummy" if shape else "auto") as llm:
            depths[depth] = measure(llm, lengths, args.repeats, rng, args.device)
            if layers and not heads:  # at the engine's thread count
                heads = {n: head_components(config, dtype, n, args.repeats, args.device)
                         for n in lengths}
    if tmp is not None:
        tmp.cleanup()
    machine = (torch.cuda.get_device_name() if args.device == "cuda"
               else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                    f"torch threads, load average {os.getloadavg()[0]:.1f}")
    print(f"{label} on {args.device} ({machine}); medians of {args.repeats}, "
          f"max_num_batched_tokens {args.batch_tokens}")
    for depth, rows in depths.items():
        if depth:
            print(f"measured end to end at {depth} layers (reduced depth):")
        print(f"{'prompt tokens':>13} {'prefill ms':>11} {'loglik ms':>10} {'ratio':>6} "
              f"{'prefill cpu ms':>15} {'loglik cpu ms':>14} {'cpu ratio':>9}")
        for r in rows:
            print(f"{r['prompt_tokens']:>13} {r['prefill_ms']:>11.1f} "
                  f"{r['loglikelihood_ms']:>10.1f} {r['ratio']:>6.2f} "
                  f"{r['prefill_cpu_ms']:>15.1f} {r['loglikelihood_cpu_ms']:>14.1f} "
                  f"{r['cpu_ratio']:>9.2f}")
    full = extrapolate(config, depths, heads) if layers else []
    if full:
        print(f"EXTRAPOLATED to {config['num_hidden_layers']} layers from the measured "
              f"components (ms):")
        print(f"{'prompt tokens':>13} {'layer':>8} {'rest':>8} {'extra':>8} {'head_all':>9} "
              f"{'head_last':>9} {'passes':>8} {'engine ratio':>12} {'component ratio':>15}")
        for r in full:
            print(f"{r['prompt_tokens']:>13} {r['layer_ms']:>8.1f} {r['rest_ms']:>8.1f} "
                  f"{r['extra_ms']:>8.1f} {r['head_all']:>9.1f} {r['head_last']:>9.1f} "
                  f"{r['passes']:>8.1f} {r['engine_ratio']:>12.3f} {r['component_ratio']:>15.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join(sys.argv), "model": label, "device": args.device,
            "machine": machine, "torch": torch.__version__,
            "rows": [dict(r, layers=d or config.get("num_hidden_layers"))
                     for d, rows in depths.items() for r in rows], "extrapolated": full},
            indent=2) + "\n")


if __name__ == "__main__":
    main()
