"""Triton paged attention for mixed prefill/decode batches, with a split-K (FlashDecoding) path.

One kernel family serves every sequence of a batch, whatever its query length:

* A program owns one *query block* (BLOCK_Q consecutive query tokens of one sequence) and one KV
  head. The GROUP = Hq / Hkv query heads that share the KV head are folded into the M dimension
  of the tile (row r = token r // GROUP, head r % GROUP), so each K/V tile is loaded once per KV
  head and used by all of its query heads in one `tl.dot` (BLOCK_M = BLOCK_Q * GROUP >= 16).
* Query blocks are numbered per sequence without a host-side table: sequence b's blocks start at
  `query_start_loc[b] // BLOCK_Q + b`, and a program finds its sequence by binary search over
  `query_start_loc`. The grid (`T // BLOCK_Q + B` blocks) depends only on shapes, so a launch
  needs no device sync and can be captured in a CUDA graph.
* Keys are visited in tiles of TILE_N positions; each position's physical block comes from the
  block table (`position // block_size`), so TILE_N and the cache block size are independent and
  table entries past ceil(seq_len / block_size) are never loaded (every load is masked).
* Online softmax in float32 (exp2 with the scale folded into log2 units); causal masking compares
  each key's position with its query's position `seq_len - q_len + j`.
* Split-K: with NUM_SEGMENTS > 1 the tiles of each query block are cut into NUM_SEGMENTS
  contiguous ranges, one program each (grid axis 2). Each writes its un-normalised accumulator,
  running max and exp-sum; a second kernel merges them with a log-sum-exp weighting. Used
  automatically for pure-decode batches whose (sequences x KV heads) would under-fill the GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634
# Split-K heuristics. Untuned (no GPU was available when this was written): split when the
# decode grid has fewer programs than SPLIT_TARGET_PROGRAMS_PER_SM per SM, into at most
# MAX_SEGMENTS segments of at least MIN_TILES_PER_SEGMENT key tiles each.
MAX_SEGMENTS = 16
MIN_TILES_PER_SEGMENT = 4
SPLIT_TARGET_PROGRAMS_PER_SM = 2
_NOMINAL_SM_COUNT = 132  # used off-GPU (interpreter), where there is no device to ask


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
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale_log2, num_seqs, num_q_heads, block_size,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Keys [0, kv_end) are visible to at least one query of this block.
    kv_end = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if NUM_SEGMENTS == 1:
        tile_lo = 0
        tile_hi = num_tiles
    else:
        tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
        tile_lo = segment * tiles_per_segment
        tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + offs_n
        k_ok = k_pos < kv_end
        block = tl.load(table + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (k_pos % block_size) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None],
                    mask=k_ok[None, :] & dim_ok[:, None], other=0.0)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet keeps max -inf; pin it to 0 so exp2 gives 0, not NaN.
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :],
                    mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

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


@triton.jit
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
    # Segment 0 always holds key 0, so m_all is finite and empty segments (-inf) weigh 0.
    m_all = tl.max(m, axis=0)
    w = tl.exp2(m - m_all)
    total = tl.sum(l_seg * w, axis=0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(part_acc_ptr + (base + segs)[:, None] * HEAD_DIM_PAD + dims[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _NOMINAL_SM_COUNT


def choose_num_segments(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                        tile_n: int, sm_count: int) -> int:
    """Split-K factor (a power of two, 1 = no split) for a batch; only pure-decode batches split.

    The choice depends only on host-side integers, so a CUDA graph captured at a given
    (batch, max_seq_len) replays the same path; capture with the largest max_seq_len it serves.
    """
    if max_query_len != 1:
        return 1
    programs = num_seqs * num_kv_heads
    wanted = math.ceil(SPLIT_TARGET_PROGRAMS_PER_SM * sm_count / programs)
    by_length = math.ceil(max_seq_len / (tile_n * MIN_TILES_PER_SEGMENT))
    segments = min(MAX_SEGMENTS, wanted, by_length)
    if segments <= 1:
        return 1
    return min(MAX_SEGMENTS, triton.next_power_of_2(segments))


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    query_start_loc: Tensor, seq_lens: Tensor, scale: float,
                    max_query_len: int, max_seq_len: int, *, num_segments: int | None = None,
                    block_m: int | None = None, tile_n: int | None = None) -> Tensor:
    """Triton twin of `reference.paged_attention` (see ops.paged_attention for the contract).

    `num_segments` (a power of two) forces the split-K factor, `block_m`/`tile_n` the tile shape;
    None picks them from the batch. Output rows of tokens past `query_start_loc[-1]` are
    left unwritten.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype; got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous last dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    decode = max_query_len == 1
    if block_m is None:
        block_m = 16 if decode else 64
    block_m = max(block_m, 16, triton.next_power_of_2(group))
    block_q = block_m // group
    if tile_n is None:
        tile_n = 64
    if num_segments is None:
        num_segments = choose_num_segments(seq_lens.shape[0], num_kv_heads, max_query_len,
                                           max_seq_len, tile_n, _sm_count(q.device))
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two >= 1; got {num_segments}")
    head_dim_pad = triton.next_power_of_2(max(head_dim, 16))
    num_seqs = seq_lens.shape[0]
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    if num_segments > 1:
        part_max = torch.empty(num_tokens, num_q_heads, num_segments, dtype=torch.float32,
                               device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(num_tokens, num_q_heads, num_segments, head_dim_pad,
                               dtype=torch.float32, device=q.device)
    else:
        part_max = part_sum = part_acc = out  # never touched when NUM_SEGMENTS == 1
    # fp32 inputs must not silently drop to TF32 on GPU: the reference is exact fp32.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        part_acc, part_max, part_sum,
        scale * LOG2E, num_seqs, num_q_heads, k_cache.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        NUM_SEGMENTS=num_segments, DOT_PRECISION=precision,
        num_warps=4 if block_m <= 64 else 8, num_stages=2 if decode else 3,
    )
    if num_segments > 1:
        _merge_segments_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_max, part_sum, num_tokens, num_q_heads,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SEGMENTS=num_segments,
            num_warps=4,
        )
    return out
