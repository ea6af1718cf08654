"""Block-scaled FP8 W8A8 GEMM against the model-dtype GEMM, per shape: `kernels.fp8_block_linear`
(Triton on CUDA, the torch twin on CPU) vs `F.linear` in bf16 (CUDA) / fp32 (CPU), on the
projection shapes of Qwen3-8B (qkv, o, gate_up, down) at several token counts M.

    python bench/fp8_bench.py --device cuda --json out/fp8.json   # M 1..4096, Qwen3-8B shapes
    python bench/fp8_bench.py --device cpu                        # small shapes, the twin

Fixed seeds; prints a table (ms per call, FP8's speed-up) and writes it as JSON with the
command and the device. The issue's GPU target: FP8 >= 1.6x BF16 at M >= 512.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from kernels.fp8_reference import quantize_weight_blocks  # noqa: E402

# Qwen3-8B (hidden 4096, 32 q / 8 kv heads of 128, intermediate 12288): (name, N, K)
SHAPES_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096),
             ("down", 4096, 12288)]
SHAPES_CPU = [("qkv", 1024, 512), ("down", 512, 1024)]


def _time(fn, reps: int, device: str) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="M values (default: 1 32 512 2048 4096 on CUDA, 1 32 128 on CPU)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    tokens = args.tokens or ([1, 32, 512, 2048, 4096] if cuda else [1, 32, 128])
    reps = args.reps or (50 if cuda else 3)
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=args.device).manual_seed(0)
    rows = []
    for name, n, k in SHAPES_8B if cuda else SHAPES_CPU:
        w = torch.randn(n, k, device=args.device, dtype=dtype, generator=gen) * 0.02
        q, scale = quantize_weight_blocks(w, (128, 128))
        for m in tokens:
            x = torch.randn(m, k, device=args.device, dtype=dtype, generator=gen)
            base = _time(lambda x=x, w=w: F.linear(x, w), reps, args.device)
            fp8 = _time(lambda x=x, q=q, s=scale: kernels.fp8_block_linear(x, q, s, (128, 128)),
                        reps, args.device)
            rows.append({"shape": name, "M": m, "N": n, "K": k, "base_ms": base, "fp8_ms": fp8,
                         "speedup": base / fp8})
            print(f"{name:8s} M={m:5d} N={n:6d} K={k:6d}  {str(dtype)[6:]} {base:8.3f} ms  "
                  f"fp8 {fp8:8.3f} ms  {base / fp8:5.2f}x", flush=True)
    if args.json:
        device = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "device": device,
                                               "base_dtype": str(dtype), "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
