"""Triton KV-cache write: scatter this step's K and V rows into their paged slots.

One program per token writes all of its KV heads (`Hkv * D` contiguous elements of the source
row) with a single masked load/store per tensor; a slot of -1 (padding in a CUDA-graph batch)
makes the program return before touching the cache.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HD: tl.constexpr,
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
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
             slot_mapping: Tensor) -> None:
    """Triton twin of `reference.write_kv`; the last dim of every tensor must be contiguous."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous last dim; "
                         "allocate them with torch.empty(num_blocks, block_size, Hkv, D)")
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HD=triton.next_power_of_2(num_kv_heads * head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )

