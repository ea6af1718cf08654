"""Triton KV-cache write: scatter this step's K and V rows into their paged slots.

One program per token writes all of its KV heads (`Hkv * D` contiguous elements of the source
row) with a single masked load/store per tensor; a slot of -1 (padding in a CUDA-graph batch)
makes the program return before touching the cache. An FP8 cache (FP8) stores each value over
its KV head's scale (float32 `[Hkv]`: one code path for per-head and per-tensor scales, the
latter the vector filled with one value), saturated at e4m3's largest finite value (`to_cache`); the attention
kernels multiply it back in registers (`from_cache`), as `reference.quantize_kv` /
`dequantize_kv` do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def to_cache(x, scale, FP8: tl.constexpr):
    """A K/V value as the cache holds it, before the cast to the cache's dtype: FP8 keeps
    x / scale saturated at e4m3's largest finite value, 448, and rounded to e4m3's grid here
    (nearest, ties to even, as torch's cast) so that the cast is exact wherever it runs
    (Triton's interpreter drops a rounding carry into the exponent)."""
    if FP8:
        # div_rn: IEEE division (a plain `/` compiles to an approximate one on CUDA, which put
        # values near a rounding midpoint on the other side of it from torch's twin on an H100)
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0)
        bits = x.to(tl.int32, bitcast=True)
        exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # subnormals: the smallest normal's step
        step = ((exp - 3) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
        per_step = ((257 - exp) << 23).to(tl.float32, bitcast=True)  # 1 / step, exactly
        # in steps (an exact product), rounded to an integer by adding and taking off 1.5 * 2^23
        r = ((tl.abs(x) * per_step + 12582912.0) - 12582912.0) * step
        x = tl.where(bits < 0, -r, r)  # (the sign bit: -0 stays -0)
    return x


@triton.jit
def from_cache(x, scale, FP8: tl.constexpr):
    """Cached K/V as values: an FP8 cache's times its scale, in float32."""
    if FP8:
        x = x.to(tl.float32) * scale
    return x


def scale_args(k_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None
               ) -> tuple[Tensor, Tensor, bool]:
    """(k scale, v scale, FP8) for a launch: the per-KV-head scale vectors of an FP8 cache,
    else any pointer."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if not fp8:
        return k_cache, k_cache, False
    return k_scale, v_scale, True


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HD: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    idx = tl.arange(0, BLOCK_HD)
    head = idx // HEAD_DIM
    dim = idx % HEAD_DIM
    mask = idx < NUM_KV_HEADS * HEAD_DIM
    k = tl.load(key_ptr + token.to(tl.int64) * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(value_ptr + token.to(tl.int64) * stride_vt + head * stride_vh + dim, mask=mask)
    dst = block * stride_cb + offset * stride_cs + head * stride_ch + dim
    k_scale, v_scale = 1.0, 1.0
    if FP8:  # each element's KV head's scale
        k_scale = tl.load(k_scale_ptr + head, mask=mask, other=1.0)
        v_scale = tl.load(v_scale_ptr + head, mask=mask, other=1.0)
    tl.store(k_cache_ptr + dst, to_cache(k, k_scale, FP8).to(k_cache_ptr.dtype.element_ty),
             mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(v, v_scale, FP8).to(v_cache_ptr.dtype.element_ty),
             mask=mask)


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
             slot_mapping: Tensor, k_scale: Tensor | None = None,
             v_scale: Tensor | None = None) -> None:
    """Triton twin of `reference.write_kv`; the last dim of every tensor must be contiguous."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous last dim; "
                         "allocate them with torch.empty(num_blocks, block_size, Hkv, D)")
    k_scale, v_scale, fp8 = scale_args(k_cache, k_scale, v_scale)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HD=triton.next_power_of_2(num_kv_heads * head_dim), FP8=fp8,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )

