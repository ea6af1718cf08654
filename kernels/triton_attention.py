"""Triton paged attention for mixed prefill/decode batches, with a split-K (FlashDecoding) path.

One kernel serves every sequence of a batch, whatever its query length:

* A program owns one *query block* of one sequence and FOLD query heads. With FOLD = GROUP
  (= Hq / Hkv; decode and short chunks) the query heads that share a KV head are folded into the
  M dimension of the tile (row r = token r // FOLD, head r % FOLD), so each K/V tile is loaded
  once per KV head. With FOLD = 1 (long chunks) a program owns BLOCK_M tokens of one query head:
  Hopper's MMA tile without head interleaving; the GROUP programs that share a KV head read
  the same K/V tiles, mostly from L2. A batch holding long chunks and other sequences runs
  two launches, each skipping the other's sequences (by query length).
* Query blocks are numbered per sequence without a host-side table: sequence b's blocks start at
  `query_start_loc[b] // BLOCK_Q + b`, and a program finds its sequence by binary search over
  `query_start_loc`. The grid (`T // BLOCK_Q + B` blocks) depends only on shapes, so a launch
  needs no device sync and can be captured in a CUDA graph. Programs take query blocks in
  reverse order, so the long (late, causal) blocks start first.
* Keys come in two runs. The cached prefix, positions [0, context_len), is read through the
  block table (`position // block_size`, so TILE_N and the cache block size are independent
  and table entries past ceil(seq_len / block_size) are never loaded). This step's own keys,
  chunk positions [0, q_len), are read from the contiguous `key`/`value` rows when the caller
  passes them (HAS_CHUNK_KV), else from the cache like the prefix. Every prefix key and every
  chunk key before the block's first query is visible to the whole block: those tiles run with
  no mask at all; only a partial prefix tile and the diagonal tiles are masked, and tiles past
  the block's last query are never visited.
* Online softmax in float32 (exp2 with the scale folded into log2 units).
* An FP8 cache (FP8) is read as e4m3 and multiplied by its KV head's scale in registers
  (`triton_kv.from_cache`), then cast to q's dtype for the dot products; no copy of the cache
  in another dtype is ever made. Its chunk keys are read from the cache too (never from the
  full-precision `key`/`value` rows), so every key is the value a later step will read.
* Split-K: with NUM_SEGMENTS > 1 the prefix tiles of each query block are cut into
  NUM_SEGMENTS contiguous ranges, one program each (grid axis 2); the last one also attends
  the chunk's own keys. Each writes its un-normalised accumulator, running max and exp-sum; a
  second kernel merges them with a log-sum-exp weighting. Used for pure-decode batches, by
  `attention_split.choose_num_segments` (a table of H100 measurements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.attention_split import TILE_N, choose_num_segments, device_sm_count
from kernels.triton_kv import from_cache, scale_args

LOG2E = 1.4426950408889634
# Prefill tiles: chunks of at least LONG_CHUNK tokens get unfolded 128-row query tiles.
LONG_CHUNK = 128
_INT32_MAX = 2**31 - 1


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks contain `q_block_global` (largest b with start_b <= it)."""
    # Annotated so both stay int32 tensors across iterations even when num_seqs == 1 arrives
    # as a specialised constant.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_rows(ptrs, row_ok, dim_ok, ROW_MASK: tl.constexpr, DIM_MASK: tl.constexpr):
    """A [rows, dims] tile; masks (zero fill) only where the caller says they can be needed."""
    if ROW_MASK:
        if DIM_MASK:
            return tl.load(ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    if DIM_MASK:
        return tl.load(ptrs, mask=dim_ok[None, :], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k, v, visible, scale_log2,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step of q [M, D] over a key tile k, v [N, D]."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet keeps max -inf; pin it to 0 so exp2 gives 0, not NaN.
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    else:
        # Every key is visible to every row: the max is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = m_new
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_tile_offsets(table, pos, block_size, kv_head, stride_cb, stride_cs, stride_ch, ok):
    """Cache offsets of the key rows at positions `pos` (rows not `ok` read table entry 0)."""
    block = tl.load(table + pos // block_size, mask=ok, other=0).to(tl.int64)
    return block * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch


@triton.jit
def _prefix_tile(acc, m_i, l_i, q, tile, context_len, table, block_size, kv_head, dims, dim_ok,
                 k_cache_ptr, v_cache_ptr, stride_cb, stride_cs, stride_ch, scale_log2,
                 k_scale, v_scale, TILE_N: tl.constexpr, MASKED: tl.constexpr,
                 DIM_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr):
    """Attend cached-prefix tile `tile` (positions tile * TILE_N + [0, TILE_N)) via the table."""
    pos = tile * TILE_N + tl.arange(0, TILE_N)
    ok = pos < context_len
    kv = _paged_tile_offsets(table, pos, block_size, kv_head, stride_cb, stride_cs, stride_ch, ok)
    k = _load_rows(k_cache_ptr + kv[:, None] + dims[None, :], ok, dim_ok, MASKED, DIM_MASK)
    v = _load_rows(v_cache_ptr + kv[:, None] + dims[None, :], ok, dim_ok, MASKED, DIM_MASK)
    k = from_cache(k, k_scale, FP8).to(q.dtype)
    v = from_cache(v, v_scale, FP8).to(q.dtype)
    return _attend_tile(acc, m_i, l_i, q, k, v, ok[None, :], scale_log2, MASKED, DOT_PRECISION)


@triton.jit
def _chunk_tile(acc, m_i, l_i, q, tile, q_idx, q_hi, q_start, context_len, kv_head, dims, dim_ok,
                key_ptr, value_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                k_cache_ptr, v_cache_ptr, table, block_size, stride_cb, stride_cs, stride_ch,
                scale_log2, k_scale, v_scale, TILE_N: tl.constexpr, MASKED: tl.constexpr,
                DIM_MASK: tl.constexpr, HAS_CHUNK_KV: tl.constexpr, DOT_PRECISION: tl.constexpr,
                FP8: tl.constexpr):
    """Attend tile `tile` of this step's own keys (chunk positions tile * TILE_N + [0, TILE_N)),
    from the contiguous `key`/`value` rows or, without them, through the table."""
    j = tile * TILE_N + tl.arange(0, TILE_N)
    ok = j < q_hi
    if HAS_CHUNK_KV:
        rows = (q_start + j).to(tl.int64)
        k_ptrs = key_ptr + rows[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
        v_ptrs = value_ptr + rows[:, None] * stride_vt + kv_head * stride_vh + dims[None, :]
    else:
        kv = _paged_tile_offsets(table, context_len + j, block_size, kv_head, stride_cb,
                                 stride_cs, stride_ch, ok)
        k_ptrs = k_cache_ptr + kv[:, None] + dims[None, :]
        v_ptrs = v_cache_ptr + kv[:, None] + dims[None, :]
    k = _load_rows(k_ptrs, ok, dim_ok, MASKED, DIM_MASK)
    v = _load_rows(v_ptrs, ok, dim_ok, MASKED, DIM_MASK)
    if not HAS_CHUNK_KV:
        k = from_cache(k, k_scale, FP8).to(q.dtype)
        v = from_cache(v, v_scale, FP8).to(q.dtype)
    visible = (j[None, :] <= q_idx[:, None]) & ok[None, :]
    return _attend_tile(acc, m_i, l_i, q, k, v, visible, scale_log2, MASKED, DOT_PRECISION)


# One compiled kernel per launch type (decode, folded or unfolded prefill tiles, split-K
# factor) serves every batch, so no request pays for a compile the warm-up did not do: the
# per-step integers (num_seqs, the q_len bounds, the block table's row stride, its width
# following max_seq_len) are never specialised (== 1, divisible by 16), nor are the step
# metadata's pointers on their 16-byte alignment (query_start_loc is a view into the step's
# staging buffer at 4 * num_seqs bytes; each is read one value at a time, never vectorised).
@triton.jit(do_not_specialize=["num_seqs", "q_len_lo", "q_len_hi", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr",
                                            "seq_lens_ptr"])
def _paged_attention_kernel(
    out_ptr, q_ptr, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr,
    query_start_loc_ptr, seq_lens_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale_log2, num_seqs, num_q_heads, block_size, q_len_lo, q_len_hi,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, FOLD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, HAS_CHUNK_KV: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    q_block_global = tl.num_programs(0) - 1 - tl.program_id(0)
    head_slot = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    q_lo = q_block * BLOCK_Q
    if q_lo >= q_len:
        return
    if (q_len < q_len_lo) | (q_len > q_len_hi):  # another launch's sequence
        return
    q_hi = tl.minimum(q_len, q_lo + BLOCK_Q)
    context_len = tl.load(seq_lens_ptr + seq) - q_len
    kv_head = head_slot * FOLD // GROUP

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_lo + rows // FOLD
    head = head_slot * FOLD + rows % FOLD
    row_ok = (rows < BLOCK_Q * FOLD) & (q_idx < q_len)
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    DIM_MASK: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    q = _load_rows(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                   row_ok, dim_ok, True, DIM_MASK)

    # The block's tile sequence: prefix tiles [0, n_pre) of which the first n_pre_full are full,
    # then chunk tiles [n_pre, n_pre + n_chunk) of which the first n_chunk_full precede the
    # block's first query (visible to all of its rows).
    n_pre_full = context_len // TILE_N
    n_pre = tl.cdiv(context_len, TILE_N)
    n_chunk_full = q_lo // TILE_N
    n_chunk = tl.cdiv(q_hi, TILE_N)
    if NUM_SEGMENTS == 1:
        lo = 0
        hi = n_pre + n_chunk
    else:
        # The segments share the prefix tiles; the last one also takes the chunk's tiles (a
        # decode's single key), so a context of NUM_SEGMENTS tiles is one tile per segment.
        per_segment = tl.cdiv(n_pre, NUM_SEGMENTS)
        lo = tl.minimum(segment * per_segment, n_pre)
        hi = tl.minimum(lo + per_segment, n_pre)
        if segment == NUM_SEGMENTS - 1:
            hi = n_pre + n_chunk

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_scale, v_scale = 1.0, 1.0
    if FP8:  # the program's KV head's scales
        k_scale, v_scale = tl.load(k_scale_ptr + kv_head), tl.load(v_scale_ptr + kv_head)

    # Prefix: full tiles unmasked, then the partial last tile (at most one).
    for tile in range(lo, tl.minimum(hi, n_pre_full)):
        acc, m_i, l_i = _prefix_tile(
            acc, m_i, l_i, q, tile, context_len, table, block_size, kv_head, dims, dim_ok,
            k_cache_ptr, v_cache_ptr, stride_cb, stride_cs, stride_ch, scale_log2,
            k_scale, v_scale, TILE_N, False, DIM_MASK, DOT_PRECISION, FP8)
    for tile in range(tl.maximum(lo, n_pre_full), tl.minimum(hi, n_pre)):
        acc, m_i, l_i = _prefix_tile(
            acc, m_i, l_i, q, tile, context_len, table, block_size, kv_head, dims, dim_ok,
            k_cache_ptr, v_cache_ptr, stride_cb, stride_cs, stride_ch, scale_log2,
            k_scale, v_scale, TILE_N, True, DIM_MASK, DOT_PRECISION, FP8)
    # Chunk: tiles before the block's first query unmasked, then the diagonal tiles.
    for tile in range(tl.maximum(lo, n_pre), tl.minimum(hi, n_pre + n_chunk_full)):
        acc, m_i, l_i = _chunk_tile(
            acc, m_i, l_i, q, tile - n_pre, q_idx, q_hi, q_start, context_len, kv_head, dims,
            dim_ok, key_ptr, value_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
            k_cache_ptr, v_cache_ptr, table, block_size, stride_cb, stride_cs, stride_ch,
            scale_log2, k_scale, v_scale, TILE_N, False, DIM_MASK, HAS_CHUNK_KV, DOT_PRECISION,
            FP8)
    for tile in range(tl.maximum(lo, n_pre + n_chunk_full), hi):
        acc, m_i, l_i = _chunk_tile(
            acc, m_i, l_i, q, tile - n_pre, q_idx, q_hi, q_start, context_len, kv_head, dims,
            dim_ok, key_ptr, value_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
            k_cache_ptr, v_cache_ptr, table, block_size, stride_cb, stride_cs, stride_ch,
            scale_log2, k_scale, v_scale, TILE_N, True, DIM_MASK, HAS_CHUNK_KV, DOT_PRECISION,
            FP8)

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part = (token * num_q_heads + head) * NUM_SEGMENTS + segment
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc,
                 mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_tokens"])
def _merge_segments_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_tokens, num_q_heads,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * num_q_heads + head) * NUM_SEGMENTS
    segs = tl.arange(0, NUM_SEGMENTS)
    m = tl.load(part_max_ptr + base + segs)
    l_seg = tl.load(part_sum_ptr + base + segs)
    # Some segment holds the sequence's first key (prefix key 0, or chunk key 0), which every
    # query sees, so m_all is finite and empty segments (-inf) weigh 0.
    m_all = tl.max(m, axis=0)
    w = tl.exp2(m - m_all)
    total = tl.sum(l_seg * w, axis=0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(part_acc_ptr + (base + segs)[:, None] * HEAD_DIM_PAD + dims[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    query_start_loc: Tensor, seq_lens: Tensor, scale: float,
                    max_query_len: int, max_seq_len: int, key: Tensor | None = None,
                    value: Tensor | None = None, k_scale: Tensor | None = None,
                    v_scale: Tensor | None = None, *, num_segments: int | None = None,
                    block_m: int | None = None, tile_n: int | None = None,
                    fold_gqa: bool | None = None, num_warps: int | None = None,
                    num_stages: int | None = None) -> Tensor:
    """Triton twin of `reference.paged_attention` (see ops.paged_attention for the contract).

    The keyword-only arguments force what is otherwise picked from the batch: the split-K factor
    (a power of two), the tile shape, whether GQA groups fold into the query tile (forcing it or
    `block_m` runs every sequence in one launch), and the launch options. Output rows of tokens
    past `query_start_loc[-1]` are left unwritten.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    k_scale, v_scale, fp8 = scale_args(k_cache, k_scale, v_scale)
    if (q.dtype != k_cache.dtype and not fp8) or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype (or the caches be FP8); "
                         f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous last dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    has_chunk_kv = key is not None and not fp8  # (FP8: every key as the cache holds it)
    if has_chunk_kv:
        if key.dtype != q.dtype or value.dtype != q.dtype:
            raise ValueError(f"key/value must have q's dtype {q.dtype}; got {key.dtype}, "
                             f"{value.dtype}")
        if key.stride(-1) != 1:
            key = key.contiguous()
        if value.stride(-1) != 1:
            value = value.contiguous()
    else:
        key = value = q  # never read without HAS_CHUNK_KV
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    decode = max_query_len == 1
    num_seqs = seq_lens.shape[0]
    if tile_n is None:
        tile_n = TILE_N
    if num_segments is None:
        num_segments = choose_num_segments(num_seqs, num_kv_heads, max_query_len, max_seq_len,
                                           tile_n, device_sm_count(q.device))
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two >= 1; got {num_segments}")
    head_dim_pad = triton.next_power_of_2(max(head_dim, 16))
    if num_segments > 1:
        part_max = torch.empty(num_tokens, num_q_heads, num_segments, dtype=torch.float32,
                               device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(num_tokens, num_q_heads, num_segments, head_dim_pad,
                               dtype=torch.float32, device=q.device)
    else:
        part_max = part_sum = part_acc = out  # never touched when NUM_SEGMENTS == 1
    # Which tiles serve which sequences: (fold GQA groups?, shortest q_len, longest q_len).
    # A batch with long chunks and (possibly) short ones (decodes, short chunks) gets two
    # launches, so the short ones keep the folded tiles that read each K/V tile once per KV head.
    long_batch = max_query_len >= LONG_CHUNK
    if fold_gqa is not None or block_m is not None:
        launches = [(not long_batch if fold_gqa is None else fold_gqa, 1, _INT32_MAX)]
    elif long_batch and num_seqs > 1:
        launches = [(False, LONG_CHUNK, _INT32_MAX), (True, 1, LONG_CHUNK - 1)]
    else:
        launches = [(not long_batch, 1, _INT32_MAX)]
    # fp32 inputs must not silently drop to TF32 on GPU: the reference is exact fp32.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    for fold_groups, q_len_lo, q_len_hi in launches:
        fold = group if fold_groups else 1
        tile_m = block_m or (16 if decode else (64 if fold_groups else 128))
        tile_m = max(tile_m, 16, triton.next_power_of_2(fold))
        block_q = tile_m // fold
        grid = (num_tokens // block_q + num_seqs, num_q_heads // fold, num_segments)
        _paged_attention_kernel[grid](
            out, q, key, value, k_cache, v_cache, k_scale, v_scale, block_tables,
            query_start_loc, seq_lens,
            part_acc, part_max, part_sum,
            scale * LOG2E, num_seqs, num_q_heads, k_cache.shape[1], q_len_lo, q_len_hi,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            GROUP=group, FOLD=fold, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            BLOCK_M=tile_m, BLOCK_Q=block_q, TILE_N=tile_n,
            NUM_SEGMENTS=num_segments, HAS_CHUNK_KV=has_chunk_kv, DOT_PRECISION=precision,
            FP8=fp8, num_warps=num_warps or (4 if tile_m <= 64 else 8),
            num_stages=num_stages or (2 if decode else 3),
        )
    if num_segments > 1:
        _merge_segments_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_max, part_sum, num_tokens, num_q_heads,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SEGMENTS=num_segments,
            num_warps=4,
        )
    return out
