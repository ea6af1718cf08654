"""Triton block-scaled W8A8 GEMM: `x [M, K] @ W.T` with `W` e4m3 and one scale per
`[bn, bk]` block (kernels/fp8_reference.py states the format and the twin).

One program computes an `[BLOCK_M, BLOCK_N]` tile; its K loop steps one weight block
(`BLOCK_K == bk`) at a time: it loads the activations' `[BLOCK_M, bk]` slice, quantizes it on
the fly (one scale per row: its absolute maximum over 448, rounded to e4m3 as torch's cast
does, `triton_kv.to_cache`), takes the e4m3 dot product with the weight tile and adds it times
the row scales and the weight tile's per-column block scales to a float32 accumulator. The
activations are never written back quantized. Under the interpreter (CPU tests) the dot runs
on the e4m3 values widened to float32: the same products, since e4m3 x e4m3 is exact in
float32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_kv import to_cache

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # (read when kernels are defined)


@triton.jit
def _w8a8_block_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_wsn, stride_om,
    SCALE_BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_FP8: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        k_mask = k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        a_scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / 448.0
        xq = to_cache(x, a_scale[:, None], True)  # e4m3 values (rounded), as float32
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        w_scale = tl.load(ws_ptr + (offs_n // SCALE_BLOCK_N) * stride_wsn + kb,
                          mask=n_mask, other=0.0)
        if DOT_FP8:
            part = tl.dot(xq.to(tl.float8e4nv), tl.trans(w))
        else:
            part = tl.dot(xq, tl.trans(w.to(tl.float32)), input_precision="ieee")
        acc += part * a_scale[:, None] * w_scale[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_block_linear(x: Tensor, weight: Tensor, weight_scale_inv: Tensor,
                     block: tuple[int, int]) -> Tensor:
    """`[M, N]` in x's dtype; x `[M, K]` contiguous rows, weight e4m3 `[N, K]`, scales
    float32 `[ceil(N/bn), ceil(K/bk)]`."""
    m, k = x.shape
    n = weight.shape[0]
    bn, bk = block
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = min(128, bn)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a8_block_kernel[grid](
        x, weight, weight_scale_inv, out, m, n, k,
        x.stride(0), weight.stride(0), weight_scale_inv.stride(0), out.stride(0),
        SCALE_BLOCK_N=bn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
        DOT_FP8=not INTERPRET, num_warps=4, num_stages=3)
    return out
