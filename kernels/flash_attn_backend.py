"""Optional flash-attn backend for paged attention (`attention_backend: flash_attn`).

A thin adapter, deliberately: flash-attn cannot be installed on the machines this project is
built and tested on (no CUDA toolchain, no matching wheel), so this file is not exercised by CI
beyond its "not importable" error. It maps our batch description onto flash-attn 2's paged API:

* pure decode (`max_query_len == 1`): `flash_attn_with_kvcache(q[:, None], k_cache, v_cache,
  cache_seqlens=seq_lens, block_table=block_tables, causal=True)`;
* otherwise: `flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=query_start_loc,
  cu_seqlens_k=cumsum(seq_lens), ..., causal=True, block_table=block_tables)`.

flash-attn's causal mask is aligned to the bottom-right corner (query j of a q_len chunk sees keys
up to seq_len - q_len + j), which is our convention. Upstream flash-attn 2 requires the paged
cache's block size to be a multiple of 256 (vLLM's fork lifts this); smaller blocks raise a
ValueError here instead of failing inside the extension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

FLASH_ATTN_MIN_BLOCK_SIZE = 256


def _flash_attn():
    try:
        import flash_attn
    except ImportError as exc:
        raise ValueError("attention_backend 'flash_attn' needs the flash-attn package, which is "
                         "not importable here; use attention_backend 'auto' or 'triton'") from exc
    return flash_attn


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    query_start_loc: Tensor, seq_lens: Tensor, scale: float,
                    max_query_len: int, max_seq_len: int) -> Tensor:
    """Same contract as `kernels.ops.paged_attention`, computed by flash-attn's paged kernels."""
    fa = _flash_attn()
    if not q.is_cuda:
        raise ValueError("attention_backend 'flash_attn' needs CUDA tensors")
    if k_cache.shape[1] % FLASH_ATTN_MIN_BLOCK_SIZE:
        raise ValueError(f"flash-attn's paged KV needs block_size to be a multiple of "
                         f"{FLASH_ATTN_MIN_BLOCK_SIZE}; got {k_cache.shape[1]}. Use "
                         f"attention_backend 'triton' or a larger block_size")
    if max_query_len == 1:
        return fa.flash_attn_with_kvcache(
            q.unsqueeze(1), k_cache, v_cache, cache_seqlens=seq_lens, block_table=block_tables,
            softmax_scale=scale, causal=True,
        ).squeeze(1)
    cu_seqlens_k = F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
    return fa.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens_q=query_start_loc, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len, softmax_scale=scale, causal=True,
        block_table=block_tables,
    )
