"""CPU linear products: `F.linear` against `kernels.linear` on a oneDNN-packed weight, interleaved.

Shapes: Qwen3-0.6B's projections (qkv [4096, 1024], gate_up [6144, 1024], down [1024, 3072]) and
its LM head ([151936, 1024]), and qwen3-tiny's (gate_up [768, 128], down [128, 384], LM head
[151936, 128] and a tp-2 rank's half of it), at 1, 16, 64 and 256 rows, bf16 and fp32, one
torch thread (what a CPU rank runs with on this project's 2-core CI host,
workers/cpu_threads.py). Each round times both forms (and `W x^T`, the unpacked CPU LM head's
form for up to 8 rows, and `x T` over a transposed `[in, out]` copy, the narrow fp32 head's
form for one row) back to back, so load on a shared machine hits them alike; the table is the
medians. Before each product `--evict-mb` of other memory is written (default 96: three times
this CPU's 32 MiB L3), so the weight streams from memory as it does in a step, where the
layers run between two head products; 0 measures weights left in cache by the product before.
This is the measurement behind kernels/cpu_linear.py's choice of what to pack.

    python bench/cpu_linear_bench.py [--rounds 9] [--threads 1] [--json out.json]
        [--shapes "tiny lm_head" "tiny lm_head/2"] [--dtypes float32] [--rows 1 8]
        [--evict-mb 96]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernels  # noqa: E402

SHAPES = {"0.6b qkv": (4096, 1024), "0.6b gate_up": (6144, 1024), "0.6b down": (1024, 3072),
          "0.6b lm_head": (151936, 1024), "tiny gate_up": (768, 128), "tiny down": (128, 384),
          "tiny lm_head": (151936, 128), "tiny lm_head/2": (75968, 128)}
ROWS = (1, 16, 64, 256)


def _median_s(fns: dict[str, Callable[[], object]], rounds: int,
              evict: torch.Tensor) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm-up (first-call allocations, oneDNN primitive creation)
    for r in range(rounds):
        for k, f in fns.items():
            evict.fill_(r)
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def run(rounds: int, shapes: list[str], dtypes: list[str], row_counts: list[int],
        evict_mb: int = 96) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(0)
    evict = torch.empty(evict_mb << 18)  # (fp32: 4 bytes an element)
    rows = []
    for dtype in (getattr(torch, d) for d in dtypes):
        for name in shapes:
            n, k = SHAPES[name]
            w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)  # packed whatever the dtype
            wt = w.t().contiguous()
            for m in row_counts:
                x = torch.randn(m, k, generator=gen).to(dtype)
                big = n * m > 151936 * 64  # the LM head's large cases: fewer rounds
                t = _median_s({"f_linear": lambda x=x, w=w: F.linear(x, w),
                               "packed": lambda x=x, w=w, p=packed: kernels.linear(x, w, p),
                               "w_xt": lambda x=x, w=w: torch.mm(w, x.t()).t().contiguous(),
                               "x_t": lambda x=x, wt=wt: torch.mm(x, wt)},
                              max(3, rounds // 3) if big else rounds, evict)
                row = {"dtype": str(dtype).removeprefix("torch."), "shape": name, "rows": m,
                       "f_linear_ms": 1e3 * t["f_linear"], "packed_ms": 1e3 * t["packed"],
                       "w_xt_ms": 1e3 * t["w_xt"], "x_t_ms": 1e3 * t["x_t"],
                       "speedup": t["f_linear"] / t["packed"],
                       "packed_gflops": 2 * m * n * k / t["packed"] / 1e9}
                print(f"{row['dtype']:9s} {name:13s} M={m:4d}  F.linear {row['f_linear_ms']:9.3f} ms"
                      f"  packed {row['packed_ms']:9.3f} ms  {row['speedup']:5.2f}x"
                      f"  (W x^T {row['w_xt_ms']:9.3f} ms, x T {row['x_t_ms']:9.3f} ms)",
                      flush=True)
                rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float32"],
                    default=["bfloat16", "float32"])
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--evict-mb", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from throughput import machine

    load = os.getloadavg()[0]
    rows = run(args.rounds, args.shapes, args.dtypes, args.rows, args.evict_mb)
    result = {"machine": machine(), "load_before": load, "load_after": os.getloadavg()[0],
              "evict_mb": args.evict_mb, "rows": rows}
    print(f"load average {load:.2f} -> {result['load_after']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
