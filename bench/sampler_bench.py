"""Sampler benchmark: one step's sampling of S rows over Qwen3's vocabulary (151,936).

Modes, timed round-robin in one process (the VM's speed drifts; interleaving hits every mode
alike; the full-sort modes after the others, since their gigabyte of sort buffers at 256 rows
slows whatever runs next on the CPU), median of `--reps`:
- greedy: every row temperature 0 (`Sampler` takes the argmax only);
- unseeded / seeded: temperature 0.8; keys as the model runner derives them (from the engine
  seed and the sequence id, or from the request's seed), so both run the same op;
- seeded+top_p: the same with top_p 0.95 (the masks order the whole vocabulary);
- seeded+top_k+top_p: top_k 20 and top_p 0.95 (Qwen3's recommended sampling); the masks order
  only the 20 largest values per row (`SamplingMetadata.max_top_k`, a partial selection);
  `..., full sort` is the same rows with every value ordered (max_top_k unset), for A/B;
- per-row generators: what a seeded row cost before the counter-based streams (one
  `torch.Generator.manual_seed` and one `exponential_` over the vocabulary per row, then the
  exponential race), for scale.
Also the torch twin of the draw (`backend="torch"`) beside what the modes above run (the Triton
kernel on CUDA, the C++ op of kernels/csrc/sample_cpu.cpp on CPU). With
`--compare-ref REF`, also `sample_simple` of `workers/sampler.py` as it was at git REF (loaded
from its source, if it imports nothing of the project) on the unseeded rows.

    python bench/sampler_bench.py [--rows 1 32 256] [--reps 7] [--threads N]
                                  [--device cpu|cuda] [--compare-ref REF] [--json out.json]

Target (issue #14): 256 seeded rows cost <= 1.5x the unseeded ones.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable

import torch

from kernels import ops
from workers import sampler as sampler_module
from workers.sampler import Sampler, SamplingMetadata, stream_key

VOCAB = 151936
SEED = 0
TEMPERATURE = 0.8
FULL_SORT_TOP_K = "seeded+top_k+top_p, full sort"


def metadata(rows: int, device: torch.device, *, greedy: bool, seeded: bool,
             top_p: float = 1.0, top_k: int = 0, max_top_k: int | None = None
             ) -> SamplingMetadata:
    # Unseeded rows: the engine seed and the sequence id (as workers/seq_table.py keys them).
    keys = [stream_key(1000 + r, 0) if seeded else stream_key(SEED, (1 << 40) + r)
            for r in range(rows)]
    return SamplingMetadata(
        temperature=torch.full((rows,), 0.0 if greedy else TEMPERATURE, device=device),
        all_greedy=greedy,
        top_k=torch.full((rows,), top_k, dtype=torch.int32, device=device) if top_k else None,
        top_p=torch.full((rows,), top_p, device=device) if top_p < 1 else None, min_p=None,
        rng_key=torch.tensor(keys, device=device),
        rng_counter=torch.arange(rows, device=device) + 17, penalties=None,
        max_num_logprobs=None, max_top_k=max_top_k)


def per_row_generators(logits: torch.Tensor) -> torch.Tensor:
    """The pre-#14 seeded draw: a generator per row, the exponential race over its noise."""
    probs = (logits / TEMPERATURE).softmax(dim=-1)
    gen = torch.Generator(device=logits.device)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for r in range(logits.shape[0]):
        gen.manual_seed(1000 + r)
        noise = torch.empty_like(probs[r]).exponential_(generator=gen)
        out[r] = (probs[r] / noise).argmax()
    return out


def sampler_at(ref: str) -> types.ModuleType:
    """`workers/sampler.py` as of git `ref`, as a module of its own."""
    source = subprocess.run(["git", "show", f"{ref}:workers/sampler.py"], check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType(f"sampler_at_{ref}")
    sys.modules[module.__name__] = module  # (dataclasses look their module up)
    exec(compile(source, f"{ref}:workers/sampler.py", "exec"), module.__dict__)
    return module


def modes(logits: torch.Tensor, ref: types.ModuleType | None
          ) -> dict[str, Callable[[], torch.Tensor]]:
    rows, device = logits.shape[0], logits.device
    sampler = Sampler()
    greedy = metadata(rows, device, greedy=True, seeded=False)
    unseeded = metadata(rows, device, greedy=False, seeded=False)
    seeded = metadata(rows, device, greedy=False, seeded=True)
    top_p = metadata(rows, device, greedy=False, seeded=True, top_p=0.95)
    top_k_p = metadata(rows, device, greedy=False, seeded=True, top_p=0.95, top_k=20,
                       max_top_k=20)
    top_k_p_sort = metadata(rows, device, greedy=False, seeded=True, top_p=0.95, top_k=20)
    out = {
        "greedy": lambda: sampler(logits, greedy).token_ids,
        "unseeded": lambda: sampler(logits, unseeded).token_ids,
        "seeded": lambda: sampler(logits, seeded).token_ids,
        "seeded+top_p": lambda: sampler(logits, top_p).token_ids,
        "seeded+top_k+top_p": lambda: sampler(logits, top_k_p).token_ids,
        FULL_SORT_TOP_K: lambda: sampler(logits, top_k_p_sort).token_ids,
        "per-row generators": lambda: per_row_generators(logits),
    }
    if ref is not None:
        out[f"unseeded, {ref.__name__[11:]}"] = lambda: ref.sample_simple(
            logits, unseeded.temperature, unseeded.rng_key, unseeded.rng_counter)
    if logits.dtype == torch.float32 or logits.is_cuda:  # (the C++ op takes float32)
        out["unseeded, torch twin"] = lambda: ops.sample_tokens(
            logits, unseeded.rng_key, unseeded.rng_counter, unseeded.temperature,
            backend="torch")
    return out


def time_once(fn: Callable[[], torch.Tensor], cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench(rows: int, device: torch.device, reps: int, dtype: torch.dtype,
          ref: types.ModuleType | None) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(SEED + rows)
    logits = (torch.randn(rows, VOCAB, generator=gen, device=device) * 3).to(dtype)
    fns = modes(logits, ref)
    cuda = device.type == "cuda"
    times: dict[str, list[float]] = {name: [] for name in fns}
    sorting = ["seeded+top_p", FULL_SORT_TOP_K]
    for group in ([n for n in fns if n not in sorting], sorting):
        for name in group:  # warm-up (Triton compiles, allocator settles)
            fns[name]()
        for _ in range(reps):
            for name in group:
                times[name].append(time_once(fns[name], cuda))
    base = statistics.median(times["unseeded"])
    return [{"device": device.type, "rows": rows, "mode": name,
             "ms": statistics.median(t) * 1e3, "vs_unseeded": statistics.median(t) / base,
             "runs_ms": [round(x * 1e3, 3) for x in t]} for name, t in times.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--compare-ref", help="also time sample_simple as of this git ref")
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        help="only this device (default: the CPU, and CUDA when present)")
    parser.add_argument("--json", help="write the results to this path")
    args = parser.parse_args()
    ref = sampler_at(args.compare_ref) if args.compare_ref else None
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = [(torch.device("cpu"), torch.float32)]
    if torch.cuda.is_available():
        devices.append((torch.device("cuda"), torch.bfloat16))
    if args.device:
        devices = [d for d in devices if d[0].type == args.device]
        if not devices:
            parser.error(f"--device {args.device}: torch sees no such device here")
    print(f"vocab {VOCAB}, temperature {TEMPERATURE}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
          + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
    print(f"sampler code: {sampler_module.__file__}")  # (which checkout: see PYTHONPATH)
    results = []
    print(f"{'device':6} {'rows':>5}  {'mode':24} {'ms (median)':>12} {'vs unseeded':>12}")
    for device, dtype in devices:
        for rows in args.rows:
            for r in bench(rows, device, args.reps, dtype, ref):
                results.append(r)
                print(f"{r['device']:6} {r['rows']:5d}  {r['mode']:24} {r['ms']:12.3f} "
                      f"{r['vs_unseeded']:11.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab": VOCAB, "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
