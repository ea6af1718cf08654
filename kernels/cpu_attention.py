"""Paged attention on CPU: torch's fused scaled-dot-product attention over the paged cache.

What `backend="auto"` runs for CPU tensors (`kernels.ops.paged_attention`); the plain-torch
twin in `kernels/reference.py` (HF's eager attention, operation for operation) stays the oracle
this path is tested against, and is what `backend="torch"` runs.

Each sequence's blocks are read from the cache once, with one `index_select` of whole blocks
(contiguous rows), and handed to `F.scaled_dot_product_attention` as strided views: no per-head
copies, no float32 copies of a float32 cache, no [Hq, L] score tensor with a mask filled in.
Decode rows (one query token) of the whole batch go through one SDPA call, the query heads of
one KV head standing in for its query rows (GQA without repeating K/V); the other sequences
(prefill chunks, verify rows) go one at a time, causal over their cached prefix.

Invariants:
- Only cache rows at positions < seq_len are ever weighted: block-table entries past a
  sequence's ceil(seq_len / block_size) are never read (padding reads block 0), and the rows
  gathered beyond a sequence's length are zeroed before the product, so whatever they hold
  (stale rows, NaN in tests) never leaks in.
- fp32 in, fp32 math; bf16/fp16 attend in their own dtype (SDPA accumulates in float32); an
  FP8 cache is dequantized to the query's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.reference import dequantize_kv

# Decode rows are attended in buckets of similar lengths, of at most this many rows (each
# bucket is one SDPA call, padded to its longest) and this many elements of gathered K (a big
# batch of long contexts never gathers gigabytes at once).
DECODE_BUCKET_ROWS = 16
DECODE_CHUNK_ELEMENTS = 1 << 24


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    query_start_loc: Tensor, seq_lens: Tensor, scale: float,
                    k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """Causal attention of a mixed prefill/decode batch over a paged KV cache: `[T, Hq, D]`.

    Same contract as `kernels.reference.paged_attention` (arguments already checked by
    `kernels.ops`): query token j of sequence b (q_len_b tokens) sits at position
    `seq_lens[b] - q_len_b + j` and attends the keys at positions <= its own.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    if len(decode) == len(lens):
        _decode_into(out, q, k_cache, v_cache, block_tables, seq_lens, lens, scale,
                     k_scale, v_scale)
        return out
    if decode:
        idx = torch.tensor(decode, dtype=torch.long)
        rows = query_start_loc.index_select(0, idx).long()
        part = torch.empty_like(q[:len(decode)])
        _decode_into(part, q.index_select(0, rows), k_cache, v_cache,
                     block_tables.index_select(0, idx), seq_lens.index_select(0, idx),
                     [lens[b] for b in decode], scale, k_scale, v_scale)
        out.index_copy_(0, rows, part)
    is_decode = set(decode)
    for b in range(len(lens)):
        if b not in is_decode and starts[b + 1] > starts[b]:
            out[starts[b]:starts[b + 1]] = _sequence(q[starts[b]:starts[b + 1]], k_cache, v_cache,
                                                     block_tables[b], lens[b], scale,
                                                     k_scale, v_scale)
    return out


def _gather(cache: Tensor, blocks: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Whole blocks `[n, block_size, Hkv, D]` of the cache, as values of `dtype`."""
    rows = cache.index_select(0, blocks)
    return dequantize_kv(rows, scale).to(dtype)


def _sequence(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_len: int,
              scale: float, k_scale: Tensor | None, v_scale: Tensor | None) -> Tensor:
    """One sequence's query rows `[q_len, Hq, D]`, the last at position seq_len - 1."""
    q_len, num_kv_heads = q.shape[0], k_cache.shape[2]
    blocks = block_table[:-(-seq_len // k_cache.shape[1])].long()
    # [Hkv, L, D] views of [L, Hkv, D] rows; slicing to seq_len drops the last block's tail.
    k = _gather(k_cache, blocks, k_scale, q.dtype).flatten(0, 1)[:seq_len].transpose(0, 1)
    v = _gather(v_cache, blocks, v_scale, q.dtype).flatten(0, 1)[:seq_len].transpose(0, 1)
    query = q.transpose(0, 1)  # [Hq, q_len, D]
    gqa = q.shape[1] != num_kv_heads
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scale,
                                           enable_gqa=gqa)
    else:  # a chunk after a cached prefix: query j sees keys <= seq_len - q_len + j
        allowed = (torch.arange(seq_len)[None, :]
                   <= torch.arange(seq_len - q_len, seq_len)[:, None])
        o = F.scaled_dot_product_attention(query, k, v, attn_mask=allowed, scale=scale,
                                           enable_gqa=gqa)
    return o.transpose(0, 1)


def _decode_into(out: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                 seq_lens: Tensor, lens: list[int], scale: float, k_scale: Tensor | None,
                 v_scale: Tensor | None) -> None:
    """Single-token queries `[B, Hq, D]` into `out`: rows in order of length, in buckets of
    at most DECODE_BUCKET_ROWS, each padded to its own longest (so a short context is not
    padded to the batch's longest), and of at most DECODE_CHUNK_ELEMENTS gathered."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    order = sorted(range(len(lens)), key=lens.__getitem__)
    lo = 0
    while lo < len(order):
        longest_allowed = max(1, DECODE_CHUNK_ELEMENTS // (num_kv_heads * head_dim))
        hi = lo + 1
        while (hi < len(order) and hi - lo < DECODE_BUCKET_ROWS
               and (hi + 1 - lo) * lens[order[hi]] <= longest_allowed):
            hi += 1
        rows = torch.tensor(order[lo:hi], dtype=torch.long)
        out.index_copy_(0, rows, _decode(q.index_select(0, rows), k_cache, v_cache,
                                         block_tables.index_select(0, rows),
                                         seq_lens.index_select(0, rows), lens[order[hi - 1]],
                                         scale, k_scale, v_scale))
        lo = hi


def _decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
            seq_lens: Tensor, longest: int, scale: float, k_scale: Tensor | None,
            v_scale: Tensor | None) -> Tensor:
    """B single-token queries, padded to the longest context: one SDPA call."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-longest // block_size)
    length = num_blocks * block_size
    needed = (seq_lens + block_size - 1) // block_size
    cols = torch.arange(num_blocks)
    blocks = torch.where(cols[None, :] < needed[:, None], block_tables[:, :num_blocks].long(), 0)
    valid = torch.arange(length)[None, :] < seq_lens[:, None]  # [B, L]
    k = _gather(k_cache, blocks.flatten(), k_scale, q.dtype).view(batch * length, -1)
    v = _gather(v_cache, blocks.flatten(), v_scale, q.dtype).view(batch * length, -1)
    pad = (~valid).flatten().nonzero().flatten()
    if pad.numel():  # fresh gathers: zeroing their padding rows in place is safe
        k.index_fill_(0, pad, 0.0)
        v.index_fill_(0, pad, 0.0)
    # [B, Hkv, L, D] views; a KV head's `group` query heads are its query rows.
    k = k.view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
    v = v.view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
    query = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(query, k, v, attn_mask=valid[:, None, None, :],
                                       scale=scale)
    return o.reshape(batch, num_q_heads, head_dim)
