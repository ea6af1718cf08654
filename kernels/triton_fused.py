"""Small fused Triton kernels: RMSNorm (+ residual add), SiLU-and-mul, and the attention prologue.

The prologue (`qk_norm_rope_write_kv`) takes the QKV projection's output and, in one launch,
applies Qwen3's per-head q/k RMSNorm and the rotary embedding in place and stores K and V into
the paged cache; plain rotary embedding is the same kernel with the norm and the store off.
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

from kernels.reference import split_qkv
from kernels.triton_kv import scale_args, to_cache


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
def _norm_rope_heads(base_ptr, stride_h, num_heads, weight_ptr, cos, sin, eps,
                     d, d_ok, HALF: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr):
    """RMSNorm over each head (NORM) then rotary, in place on `num_heads` rows of one token.

    Returns the rotated halves in float32 and their mask, for a caller that stores them again.
    """
    h = tl.arange(0, BLOCK_H)
    mask = (h[:, None] < num_heads) & d_ok[None, :]
    ptr = base_ptr + h[:, None] * stride_h + d[None, :]
    dtype = base_ptr.dtype.element_ty
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        # Rounded where Qwen3RMSNorm rounds: the normalised row, then the weight product.
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(weight_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
        x1 = (w1[None, :] * (x1 * inv[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2[None, :] * (x2 * inv[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype)
    o2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype)
    tl.store(ptr, o1, mask=mask)
    tl.store(ptr + HALF, o2, mask=mask)
    return o1, o2, mask


@triton.jit
def _qk_norm_rope_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, cos_sin_ptr,
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_cb, stride_cslot, stride_ch, block_size, num_q_heads, num_kv_heads, eps,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    NORM: tl.constexpr, WRITE_KV: tl.constexpr, FP8: tl.constexpr,
):
    """Program (t, 0) rotates token t's query heads; (t, 1) its key heads, then stores K and V
    into the paged cache at slot_mapping[t] (WRITE_KV; slot -1 = padding, not stored)."""
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
    if tl.program_id(1) == 0:
        _norm_rope_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, q_weight_ptr,
                         cos, sin, eps, d, d_ok, HALF, BLOCK_HQ, NORM)
    else:
        k1, k2, mask = _norm_rope_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads,
                                        k_weight_ptr, cos, sin, eps, d, d_ok, HALF, BLOCK_HK, NORM)
        if WRITE_KV:
            slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
            if slot >= 0:
                h = tl.arange(0, BLOCK_HK)
                dst = ((slot // block_size) * stride_cb + (slot % block_size) * stride_cslot
                       + h[:, None] * stride_ch + d[None, :])
                v_src = v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :]
                v1 = tl.load(v_src, mask=mask)
                v2 = tl.load(v_src + HALF, mask=mask)
                cache_dtype = k_cache_ptr.dtype.element_ty
                ks, vs = 1.0, 1.0
                if FP8:  # each KV head's scale
                    h_ok = h < num_kv_heads
                    ks = tl.load(k_scale_ptr + h, mask=h_ok, other=1.0)[:, None]
                    vs = tl.load(v_scale_ptr + h, mask=h_ok, other=1.0)[:, None]
                tl.store(k_cache_ptr + dst, to_cache(k1, ks, FP8).to(cache_dtype), mask=mask)
                tl.store(k_cache_ptr + dst + HALF, to_cache(k2, ks, FP8).to(cache_dtype),
                         mask=mask)
                tl.store(v_cache_ptr + dst, to_cache(v1, vs, FP8).to(cache_dtype), mask=mask)
                tl.store(v_cache_ptr + dst + HALF, to_cache(v2, vs, FP8).to(cache_dtype),
                         mask=mask)


def _launch_qk_norm_rope(positions: Tensor, q: Tensor, k: Tensor, v: Tensor,
                         q_weight: Tensor | None, k_weight: Tensor | None, eps: float,
                         cos_sin_cache: Tensor, k_cache: Tensor | None, v_cache: Tensor | None,
                         slot_mapping: Tensor | None, k_scale: Tensor | None = None,
                         v_scale: Tensor | None = None) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    norm, write_kv = q_weight is not None, k_cache is not None
    half = head_dim // 2
    cos_sin = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    cache = k_cache if write_kv else q  # never touched without WRITE_KV
    k_scale, v_scale, fp8 = scale_args(cache, k_scale, v_scale)
    if write_kv and (k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1):
        raise ValueError("k_cache and v_cache must share strides with a contiguous last dim; "
                         "allocate them with torch.empty(num_blocks, block_size, Hkv, D)")
    _qk_norm_rope_kernel[(num_tokens, 2)](
        positions, q, k, v, q_weight if norm else q, k_weight if norm else k, cos_sin,
        cache, v_cache if write_kv else q, k_scale, v_scale,
        slot_mapping if write_kv else positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin.stride(0), cache.stride(0), cache.stride(1), cache.stride(2),
        cache.shape[1] if write_kv else 1, num_q_heads, k.shape[1], eps,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        NORM=norm, WRITE_KV=write_kv, FP8=fp8, num_warps=4,
    )


def qk_norm_rope_write_kv(qkv: Tensor, num_q_heads: int, num_kv_heads: int, q_weight: Tensor,
                          k_weight: Tensor, eps: float, positions: Tensor, cos_sin_cache: Tensor,
                          k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                          k_scale: Tensor | None = None, v_scale: Tensor | None = None
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """Triton twin of `reference.qk_norm_rope_write_kv`: one launch, q and k in place in qkv."""
    q, k, v = split_qkv(qkv, num_q_heads, num_kv_heads)
    if q_weight.dtype != q.dtype or k_weight.dtype != q.dtype:
        raise ValueError(f"q/k norm weights must have the activations' dtype {q.dtype}; got "
                         f"{q_weight.dtype}, {k_weight.dtype}")
    _launch_qk_norm_rope(positions, q, k, v, q_weight.contiguous(), k_weight.contiguous(), eps,
                         cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k, v


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
    _launch_qk_norm_rope(positions, q, k, k, None, None, 0.0, cos_sin_cache, None, None, None)
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
