"""Block-scaled FP8 W8A8 GEMM against the model-dtype GEMM, per shape: `kernels.fp8_block_linear`
(Triton on CUDA, the torch twin on CPU) vs `F.linear` in bf16 (CUDA) / fp32 (CPU), on the
projection shapes of Qwen3-8B (qkv, o, gate_up, down) at several token counts M.

    python bench/fp8_bench.py --device cuda --json out/fp8.json   # M 1..4096, Qwen3-8B shapes
    python bench/fp8_bench.py --device cpu                        # small shapes, the twin

Fixed seeds; prints a table (ms per call, FP8's speed-up) and writes it as JSON with the
command and the device. The issue's GPU target: FP8 >= 1.6x BF16 at M >= 512.

On CUDA it also times torch's own FP8 GEMMs on the same quantized operands, to say whether the
Triton kernel should hand its work to them (on the 2026-11-27 H100 the Triton kernel ran at
0.20-0.44x bf16's speed at M >= 32): `scaled_mm_ms`, the block-scaled GEMM (1x128 activation
groups, 128x128 weight blocks: this project's format) through `F.scaled_mm` / `torch._scaled_mm`,
the first scale layout that runs and matches the Triton output (`scaled_mm_how`; the layouts
tried and their errors go to `torch_fp8_errors`), the activations quantized beforehand
(`act_quant_ms`: the torch twin's quantization, which a fused kernel would replace); and
`rowwise_ms`, the per-row x per-channel FP8 GEMM (`use_fast_accum`), the ceiling of what the
tensor cores give at FP8.
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
from kernels.fp8_reference import quantize_act_groups, quantize_weight_blocks  # noqa: E402

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


def _blockwise_variants(xs: torch.Tensor, ws: torch.Tensor):
    """(name, call(xq, wq) -> out) for torch's block-scaled FP8 GEMM, most likely first: the
    public `F.scaled_mm` with explicit recipes, then `torch._scaled_mm` (which infers the
    recipe from the scales' shapes), each with the scales as they come and column-major."""
    col_major = xs.t().contiguous().t()  # [M, K/128] with stride (1, M)
    out = []
    recipe = getattr(F, "ScalingType", None)
    if hasattr(F, "scaled_mm") and recipe is not None:
        for a_name, a in (("rows", xs), ("cols", col_major)):
            for b_name, b in (("w.T", ws.t()), ("w.T contig", ws.t().contiguous()), ("w", ws)):
                out.append((f"F.scaled_mm a {a_name} b {b_name}",
                            lambda xq, wq, a=a, b=b: F.scaled_mm(
                                xq, wq.t(), a, recipe.BlockWise1x128, b,
                                recipe.BlockWise128x128, output_dtype=torch.bfloat16)))
    for a_name, a in (("rows", xs), ("cols", col_major)):
        for b_name, b in (("w.T", ws.t()), ("w.T contig", ws.t().contiguous())):
            out.append((f"torch._scaled_mm a {a_name} b {b_name}",
                        lambda xq, wq, a=a, b=b: torch._scaled_mm(
                            xq, wq.t(), scale_a=a, scale_b=b, out_dtype=torch.bfloat16)))
    return out


def _torch_fp8(x, q, scale, want, reps: int, errors: dict) -> dict:
    """torch's block-scaled and row-wise FP8 GEMMs on this shape (see the module docstring)."""
    row: dict = {}
    act_quant_ms = _time(lambda: quantize_act_groups(x, 128), reps, "cuda")
    xq, xs = quantize_act_groups(x, 128)
    tol = 2e-2 * float(want.float().abs().amax()) + 1e-3
    for name, call in _blockwise_variants(xs, scale):
        try:
            got = call(xq, q)
            err = float((got.float() - want.float()).abs().amax())
            if err > tol:
                raise ValueError(f"max abs error {err:.3g} against the Triton kernel's output")
        except Exception as exc:  # a layout this torch rejects: try the next
            errors.setdefault(name, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        row.update(scaled_mm_ms=_time(lambda call=call: call(xq, q), reps, "cuda"),
                   scaled_mm_how=name, act_quant_ms=act_quant_ms)
        break
    try:
        xr = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        wr = q.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        xrq = (x.float() / xr).to(torch.float8_e4m3fn)
        wrq = (q.float() / wr).to(torch.float8_e4m3fn)
        wr_t = wr.t().contiguous()
        torch._scaled_mm(xrq, wrq.t(), scale_a=xr, scale_b=wr_t, out_dtype=torch.bfloat16,
                         use_fast_accum=True)
        row["rowwise_ms"] = _time(lambda: torch._scaled_mm(
            xrq, wrq.t(), scale_a=xr, scale_b=wr_t, out_dtype=torch.bfloat16,
            use_fast_accum=True), reps, "cuda")
    except Exception as exc:
        errors.setdefault("rowwise", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    return row


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
    errors: dict[str, str] = {}  # torch FP8 GEMM layouts that failed, first error each
    for name, n, k in SHAPES_8B if cuda else SHAPES_CPU:
        w = torch.randn(n, k, device=args.device, dtype=dtype, generator=gen) * 0.02
        q, scale = quantize_weight_blocks(w, (128, 128))
        for m in tokens:
            x = torch.randn(m, k, device=args.device, dtype=dtype, generator=gen)
            base = _time(lambda x=x, w=w: F.linear(x, w), reps, args.device)
            fp8 = _time(lambda x=x, q=q, s=scale: kernels.fp8_block_linear(x, q, s, (128, 128)),
                        reps, args.device)
            row = {"shape": name, "M": m, "N": n, "K": k, "base_ms": base, "fp8_ms": fp8,
                   "speedup": base / fp8}
            if cuda:
                want = kernels.fp8_block_linear(x, q, scale, (128, 128))
                row.update(_torch_fp8(x, q, scale, want, reps, errors))
            rows.append(row)
            extra = "".join(f"  {key} {row[key]:8.3f} ms" for key in
                            ("scaled_mm_ms", "act_quant_ms", "rowwise_ms") if key in row)
            print(f"{name:8s} M={m:5d} N={n:6d} K={k:6d}  {str(dtype)[6:]} {base:8.3f} ms  "
                  f"fp8 {fp8:8.3f} ms  {base / fp8:5.2f}x{extra}", flush=True)
    for layout, err in errors.items():
        print(f"torch FP8 GEMM, {layout}: {err}", flush=True)
    if args.json:
        device = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "device": device,
                                               "base_dtype": str(dtype), "rows": rows,
                                               "torch_fp8_errors": errors},
                                              indent=1))


if __name__ == "__main__":
    main()
