"""Small fused Triton kernels: RMSNorm (+ residual add), in-place rotary embedding, SiLU-and-mul.

Each one replaces several elementwise torch launches (and their round trips through memory) by
one. They round where Hugging Face rounds (after the residual add, before the weight multiply,
after the SiLU), computing everything else in float32, so bf16 results stay within one rounding
of the torch twins in `reference.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_kernel(
    out_ptr, x_ptr, residual_ptr, residual_out_ptr, weight_ptr,
    stride_o, stride_x, stride_r, stride_ro, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Rounded to the stream dtype exactly as torch's `x + residual` is.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / n_cols
    h = (h * tl.rsqrt(variance + eps)).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
             ) -> Tensor | tuple[Tensor, Tensor]:
    """Triton twin of `reference.rms_norm`: one program per row of the last dim."""
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    stream_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, stream_dtype),
                      device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, n_cols)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        r_out = torch.empty(x2.shape, dtype=stream_dtype, device=x.device)
    else:
        r2 = r_out = x2  # never touched without HAS_RESIDUAL
    if x2.shape[0]:
        block = triton.next_power_of_2(n_cols)
        _rms_norm_kernel[(x2.shape[0],)](
            out, x2, r2, r_out, weight.contiguous(),
            out.stride(0), x2.stride(0), r2.stride(0), r_out.stride(0), n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 8),
        )
    out = out.view(x.shape)
    return out if residual is None else (out, r_out.view(x.shape))


@triton.jit
def _rotate_heads(base_ptr, stride_h, num_heads, cos, sin, d, d_ok,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    mask = (h[:, None] < num_heads) & d_ok[None, :]
    ptr = base_ptr + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = base_ptr.dtype.element_ty
    tl.store(ptr, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(ptr + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d_ok, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=d_ok, other=0.0)
    # HF casts cos/sin to the activation dtype before using them.
    act = q_ptr.dtype.element_ty
    cos = cos.to(act).to(tl.float32)
    sin = sin.to(act).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, cos, sin, d, d_ok,
                  HALF, BLOCK_HQ)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, cos, sin, d, d_ok,
                  HALF, BLOCK_HK)


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor
                     ) -> tuple[Tensor, Tensor]:
    """Triton twin of `reference.rotary_embedding`: in place on q and k (any token/head strides)."""
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype for the Triton rotary kernel; "
                         f"got {q.dtype} and {k.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        # The kernel needs unit stride in head_dim; rotate contiguous copies and write back.
        qc, kc = q.contiguous(), k.contiguous()
        rotary_embedding(positions, qc, kc, cos_sin_cache)
        q.copy_(qc)
        k.copy_(kc)
        return q, k
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    cos_sin = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        num_q_heads, k.shape[1],
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        num_warps=4,
    )
    return q, k


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_o, stride_x, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul(x: Tensor) -> Tensor:
    """Triton twin of `reference.silu_and_mul`."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    if x2.shape[0] and inter:
        block = min(triton.next_power_of_2(inter), 1024)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            out, x2, out.stride(0), x2.stride(0), inter, BLOCK=block, num_warps=4,
        )
    return out.view(*x.shape[:-1], inter)
