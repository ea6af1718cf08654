"""Paged attention on CPU: decode rows read straight from the paged cache by a C++ op, longer
chunks on torch's fused scaled-dot-product attention.

What `backend="auto"` runs for CPU tensors (`kernels.ops.paged_attention`); the plain-torch
twin in `kernels/reference.py` (HF's eager attention, operation for operation) stays the oracle
this path is tested against, and is what `backend="torch"` runs.

Sequences of at most OP_MAX_QUERY_ROWS query rows (decode, speculative verify) go to the C++
op (`kernels/csrc/paged_attention_cpu.cpp`, built by scripts/bootstrap.sh, loaded by
`kernels/cpu_extension.py`): all of them in one call, each (sequence, KV head) reading its K/V
rows through the block table once for its whole query group, online softmax in float32. The
other sequences (prefill chunks) go one at a time to SDPA's flash kernel, causal over their
cached prefix, on whole blocks (`index_select` of blocks, sliced to seq_len, handed to SDPA as
strided views). Which sequences go where depends on the step's metadata only: `DecodePlan`
decides it once per step (kept in the metadata's `step_cache`) and every layer reuses it.

Where the op is not built (no compiler on the host) or does not take the tensors (an FP8
cache), decode rows go through one SDPA call per bucket of similar lengths instead, the query
heads of one KV head standing in for its query rows (GQA without repeating K/V), their K/V rows
read with one `index_select` of token rows each and the padding up to the bucket's longest
masked in the scores. This fallback stays because the reference twin, the other candidate, is
2.4-3.9x slower on decode (docs/benchmarks.md, "Decode attention from the paged cache in C++").

Invariants:
- Only cache rows at positions < seq_len are ever weighted: block-table entries past a
  sequence's ceil(seq_len / block_size) are never read, and a decode row's padding positions
  read that sequence's own position 0 (a row it wrote) with an additive -inf mask, so whatever
  the rest of the cache holds (stale rows, NaN in tests) never leaks in.
  The C++ op reads no position >= seq_len at all.
- A `DecodePlan` in a step cache is only used with the metadata tensors it was made from
  (the cache lives in that `AttentionMetadata`), keyed by the query dtype, cache geometry and
  whether the op runs.
- fp32 in, fp32 math; bf16/fp16 attend in their own dtype (SDPA and the op accumulate in
  float32); an FP8 cache is dequantized to the query's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cpu_extension
from kernels.reference import dequantize_kv

# Decode rows are attended in buckets of similar lengths, of at most this many rows (each
# bucket is one SDPA call, padded to its longest) and this many elements of gathered K (a big
# batch of long contexts never gathers gigabytes at once).
DECODE_BUCKET_ROWS = 16
DECODE_CHUNK_ELEMENTS = 1 << 24
# Sequences of at most this many query rows (decode, a speculative verify) go to the C++ op;
# longer chunks (prefill) to SDPA's flash kernel, which tiles the query rows.
OP_MAX_QUERY_ROWS = 8
_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class DecodeBucket:
    """Decode rows of similar lengths attended by one SDPA call, padded to the longest in
    whole blocks (L positions)."""

    rows: Tensor | None  # long [n]: its rows of the decode queries; None: all, in order
    slots: Tensor  # long [n * L]: the flat cache row of each (row, position); padding: position 0
    mask: Tensor  # [n, 1, 1, L], the query dtype: 0 where attended, -inf on padding


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """What a step's metadata says about its attention, made once and used by every layer."""

    rows: Tensor | None  # long: the decode sequences' query rows; None: every sequence decodes
    buckets: tuple[DecodeBucket, ...]
    others: tuple[tuple[int, int, int, int], ...]  # (sequence, q start, q end, seq_len)
    few: Tensor | None = None  # long: the sequences the C++ op attends; None: it is not used

    @staticmethod
    def make(block_tables: Tensor, query_start_loc: Tensor, seq_lens: Tensor,
             cache_shape: torch.Size, dtype: torch.dtype, op_rows: int = 0) -> DecodePlan:
        """With `op_rows`: the sequences of at most that many query rows go to the C++ op
        (`few`), the others one at a time to SDPA. Without: buckets of the single-token
        sequences, in order of length, of at most DECODE_BUCKET_ROWS rows and
        DECODE_CHUNK_ELEMENTS gathered elements each."""
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        # the query rows of a sequence the op takes (up to op_rows) or the buckets (exactly 1)
        fewest, short = (0, op_rows) if op_rows else (1, 1)
        decode = [b for b in range(len(lens)) if fewest <= starts[b + 1] - starts[b] <= short]
        others = tuple((b, starts[b], starts[b + 1], lens[b]) for b in range(len(lens))
                       if starts[b + 1] - starts[b] > short)
        if op_rows:
            return DecodePlan(None, (), others, torch.tensor(decode, dtype=torch.long))
        rows = (None if len(decode) == len(lens)
                else torch.tensor([starts[b] for b in decode], dtype=torch.long))
        block_size, num_kv_heads, head_dim = cache_shape[1:]
        longest_allowed = max(1, DECODE_CHUNK_ELEMENTS // (num_kv_heads * head_dim))
        order = sorted(range(len(decode)), key=lambda i: lens[decode[i]])
        buckets, lo = [], 0
        while lo < len(order):
            hi = lo + 1
            while (hi < len(order) and hi - lo < DECODE_BUCKET_ROWS
                   and (hi + 1 - lo) * lens[decode[order[hi]]] <= longest_allowed):
                hi += 1
            members = order[lo:hi]
            seqs = torch.tensor([decode[i] for i in members], dtype=torch.long)
            bucket_lens = torch.tensor([lens[decode[i]] for i in members], dtype=torch.long)
            # Padded to whole blocks, as the block-gathering path was: SDPA then splits the
            # keys the same way, so the sums (and bf16 greedy tokens) are unchanged.
            positions = torch.arange(-(-lens[decode[order[hi - 1]]] // block_size) * block_size)
            valid = positions[None, :] < bucket_lens[:, None]  # [n, L]
            pos = torch.where(valid, positions[None, :], 0)
            tables = block_tables.index_select(0, seqs).long()
            slots = tables.gather(1, pos // block_size) * block_size + pos % block_size
            mask = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, float("-inf"))
            in_order = members == list(range(len(order)))
            buckets.append(DecodeBucket(None if in_order else torch.tensor(members),
                                        slots.flatten(), mask[:, None, None, :]))
            lo = hi
        return DecodePlan(rows, tuple(buckets), others)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    query_start_loc: Tensor, seq_lens: Tensor, scale: float,
                    k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                    step_cache: dict | None = None) -> Tensor:
    """Causal attention of a mixed prefill/decode batch over a paged KV cache: `[T, Hq, D]`.

    Same contract as `kernels.reference.paged_attention` (arguments already checked by
    `kernels.ops`): query token j of sequence b (q_len_b tokens) sits at position
    `seq_lens[b] - q_len_b + j` and attends the keys at positions <= its own. `step_cache`:
    a dict that lives as long as these metadata tensors (one step: `AttentionMetadata`); the
    decode plan is made once into it and reused by every layer.
    """
    op = _op_for(q, k_cache, block_tables, query_start_loc, seq_lens)
    key = ("cpu_attention.DecodePlan", q.dtype, tuple(k_cache.shape[1:]), op is not None)
    plan = None if step_cache is None else step_cache.get(key)
    if plan is None:
        plan = DecodePlan.make(block_tables, query_start_loc, seq_lens, k_cache.shape, q.dtype,
                               OP_MAX_QUERY_ROWS if op is not None else 0)
        if step_cache is not None:
            step_cache[key] = plan
    out = torch.empty_like(q)
    if plan.few is not None:
        if plan.few.numel():
            op(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, plan.few, scale, out)
        for b, start, end, seq_len in plan.others:
            out[start:end] = _sequence(q[start:end], k_cache, v_cache, block_tables[b], seq_len,
                                       scale, k_scale, v_scale)
        return out
    if plan.rows is None:  # every sequence decodes: query row b is sequence b
        _decode_into(out, q, k_cache, v_cache, plan, scale, k_scale, v_scale)
        return out
    if plan.buckets:
        part = torch.empty_like(q[:plan.rows.shape[0]])
        _decode_into(part, q.index_select(0, plan.rows), k_cache, v_cache, plan, scale,
                     k_scale, v_scale)
        out.index_copy_(0, plan.rows, part)
    for b, start, end, seq_len in plan.others:
        out[start:end] = _sequence(q[start:end], k_cache, v_cache, block_tables[b], seq_len,
                                   scale, k_scale, v_scale)
    return out


def _op_for(q: Tensor, k_cache: Tensor, block_tables: Tensor, query_start_loc: Tensor,
            seq_lens: Tensor) -> Callable | None:
    """The C++ op when it is built and takes these tensors (an FP8 cache, int64 metadata or a
    non-contiguous cache go to SDPA)."""
    if (k_cache.dtype != q.dtype or q.dtype not in _OP_DTYPES or not k_cache.is_contiguous()
            or q.stride(2) != 1
            or any(t.dtype != torch.int32 for t in (block_tables, query_start_loc, seq_lens))):
        return None
    return cpu_extension.paged_attention_rows()


def _gather(cache: Tensor, blocks: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Rows `blocks` of the cache (whole blocks, or token rows of the flattened cache), as
    values of `dtype`."""
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
    # [1, Hq, q_len, D]: SDPA takes its flash kernel for 4-d inputs only (3-d ones fall back
    # to the math path, which materialises the [Hq, q_len, L] scores and their mask).
    query, k, v = q.transpose(0, 1)[None], k[None], v[None]
    gqa = q.shape[1] != num_kv_heads
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scale,
                                           enable_gqa=gqa)
    else:  # a chunk after a cached prefix: query j sees keys <= seq_len - q_len + j
        allowed = (torch.arange(seq_len)[None, :]
                   <= torch.arange(seq_len - q_len, seq_len)[:, None])
        o = F.scaled_dot_product_attention(query, k, v, attn_mask=allowed, scale=scale,
                                           enable_gqa=gqa)
    return o[0].transpose(0, 1)


def _decode_into(out: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: DecodePlan,
                 scale: float, k_scale: Tensor | None, v_scale: Tensor | None) -> None:
    """The plan's single-token queries `[n, Hq, D]` into `out`, bucket by bucket: each
    bucket's K/V rows gathered token by token (padding reads the sequence's first row, which
    the mask then weighs zero), one SDPA call per bucket."""
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    for bucket in plan.buckets:
        n, length = bucket.mask.shape[0], bucket.mask.shape[-1]
        query = q if bucket.rows is None else q.index_select(0, bucket.rows)
        # [n, Hkv, L, D] views of [n, L, Hkv, D] rows; a KV head's query heads are its rows.
        k = _gather(flat_k, bucket.slots, k_scale, q.dtype).view(n, length, num_kv_heads, -1)
        v = _gather(flat_v, bucket.slots, v_scale, q.dtype).view(n, length, num_kv_heads, -1)
        o = F.scaled_dot_product_attention(
            query.view(n, num_kv_heads, num_q_heads // num_kv_heads, head_dim),
            k.transpose(1, 2), v.transpose(1, 2), attn_mask=bucket.mask, scale=scale)
        o = o.reshape(n, num_q_heads, head_dim)
        if bucket.rows is None:
            out.copy_(o)
        else:
            out.index_copy_(0, bucket.rows, o)
