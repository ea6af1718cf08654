"""Plain-torch reference kernels: the CPU path and the oracle every Triton kernel is tested against.

In float32 each function computes exactly what Hugging Face's Qwen3 does (same operations in the
same order: `Qwen3RMSNorm`, `apply_rotary_pos_emb`, `eager_attention_forward`, `Qwen3MLP`), so a
model built on them reproduces transformers' greedy tokens. For fp16/bf16 inputs attention is
computed in float32 and rounded once at the end, which makes it the tighter oracle for the
Triton kernels (they also accumulate in float32).

Cache layout (shared with the Triton kernels): one K and one V tensor per layer, each
`[num_blocks, block_size, num_kv_heads, head_dim]`; token slot `s` lives at
`cache[s // block_size, s % block_size]`. An FP8 cache (`float8_e4m3fn`) holds each value
divided by its KV head's scale (`k_scale` / `v_scale`, float32 `[Hkv]`; a per-tensor scale is
that vector filled with one value), saturated at +-448; a read multiplies it back in float32
(`quantize_kv` / `dequantize_kv`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.rotary_tables import compute_cos_sin_cache  # noqa: F401 (the twins' table)

FP8_KV_DTYPE = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8_KV_DTYPE).max


def quantize_kv(x: Tensor, dtype: torch.dtype, scale: Tensor | None) -> Tensor:
    """Rows `[..., Hkv, D]` as a cache of `dtype` stores them: FP8 e4m3 holds each head's
    values over its scale (`scale` `[Hkv]`), saturated at +-448."""
    if dtype != FP8_KV_DTYPE:
        return x.to(dtype)
    return (x.to(torch.float32) / scale[:, None]).clamp(-_FP8_MAX, _FP8_MAX).to(dtype)


def dequantize_kv(x: Tensor, scale: Tensor | None) -> Tensor:
    """Cached rows `[..., Hkv, D]` as values: an FP8 cache's times each head's scale
    (`scale` `[Hkv]`), in float32; others as they are."""
    if x.dtype != FP8_KV_DTYPE:
        return x
    return x.to(torch.float32) * scale[:, None]


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
             slot_mapping: Tensor, k_scale: Tensor | None = None,
             v_scale: Tensor | None = None) -> None:
    """Store `key`/`value` `[T, Hkv, D]` at `slot_mapping` `[T]`; slots equal to -1 are skipped."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_k[slots] = quantize_kv(key[keep], k_cache.dtype, k_scale)
    flat_v[slots] = quantize_kv(value[keep], v_cache.dtype, v_scale)


def gather_kv(cache: Tensor, block_table: Tensor, seq_len: int) -> Tensor:
    """The first `seq_len` token rows `[seq_len, Hkv, D]` of one sequence, read through its block table.

    Only the first ceil(seq_len / block_size) entries of `block_table` are read; the rest is padding.
    """
    block_size = cache.shape[1]
    num_used = -(-seq_len // block_size)
    blocks = block_table[:num_used].long()
    return cache[blocks].reshape(num_used * block_size, *cache.shape[2:])[:seq_len]


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    query_start_loc: Tensor, seq_lens: Tensor, scale: float,
                    k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """Causal attention of a mixed prefill/decode batch over a paged KV cache.

    Sequence b owns query rows `q[query_start_loc[b]:query_start_loc[b + 1]]`; its last query token
    sits at position `seq_lens[b] - 1` and every query attends the keys at positions <= its own.
    """
    out = torch.empty_like(q)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    decode = (q_lens == 1).nonzero().flatten()
    if decode.numel() > 1:
        rows = query_start_loc[decode].long()
        for chunk in _decode_chunks(decode, seq_lens, k_cache):
            out[rows[chunk]] = decode_attention(q[rows[chunk]], k_cache, v_cache,
                                                block_tables[decode[chunk]],
                                                seq_lens[decode[chunk]], scale, k_scale, v_scale)
        rest = (q_lens != 1).nonzero().flatten().tolist()
    else:
        rest = range(seq_lens.shape[0])
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in rest:
        q_start, q_end = starts[b], starts[b + 1]
        if q_end > q_start:
            out[q_start:q_end] = _sequence_attention(q[q_start:q_end], k_cache, v_cache,
                                                     block_tables[b], lens[b], scale, k_scale,
                                                     v_scale)
    return out


def _sequence_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                        seq_len: int, scale: float, k_scale: Tensor | None = None,
                        v_scale: Tensor | None = None) -> Tensor:
    """One sequence's query rows `[q_len, Hq, D]`, computed as HF's eager attention does."""
    q_len = q.shape[0]
    group = q.shape[1] // k_cache.shape[2]
    # [Hq, L, D], repeated per query head the way HF's repeat_kv does it.
    k = dequantize_kv(gather_kv(k_cache, block_table, seq_len), k_scale).transpose(0, 1)
    v = dequantize_kv(gather_kv(v_cache, block_table, seq_len), v_scale).transpose(0, 1)
    k = k.repeat_interleave(group, dim=0).to(torch.float32)
    v = v.repeat_interleave(group, dim=0).to(torch.float32)
    query = q.transpose(0, 1).to(torch.float32)  # [Hq, q_len, D]
    scores = torch.matmul(query, k.transpose(1, 2)) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.matmul(probs, v).transpose(0, 1).to(q.dtype)


# Decode rows are batched (padded to the longest context) in chunks of at most this many
# float32 elements of gathered K, so a big batch of long contexts never gathers gigabytes.
_DECODE_CHUNK_ELEMENTS = 1 << 24


def _decode_chunks(decode: Tensor, seq_lens: Tensor, k_cache: Tensor) -> list[slice]:
    per_token = k_cache.shape[2] * k_cache.shape[3]
    longest = int(seq_lens[decode].max())
    step = max(1, _DECODE_CHUNK_ELEMENTS // max(1, longest * per_token))
    n = decode.numel()
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                     seq_lens: Tensor, scale: float, k_scale: Tensor | None = None,
                     v_scale: Tensor | None = None) -> Tensor:
    """Single-token queries `[B, Hq, D]` of B sequences at once: the CPU decode fast path.

    K/V are gathered padded to the longest context; padded positions are masked out of the
    softmax and zeroed in V, so whatever the padding blocks hold (even NaN) never leaks in.
    Same arithmetic as `_sequence_attention` up to float32 summation order.
    """
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    longest = int(seq_lens.max())
    num_blocks = -(-longest // block_size)
    needed = (seq_lens + block_size - 1) // block_size
    cols = torch.arange(num_blocks, device=q.device)
    blocks = torch.where(cols[None, :] < needed[:, None], block_tables[:, :num_blocks].long(), 0)
    invalid = (torch.arange(num_blocks * block_size, device=q.device)[None, :]
               >= seq_lens[:, None])  # [B, L]
    query = q.to(torch.float32).view(batch, num_kv_heads, group, head_dim)
    out = torch.empty(batch, num_kv_heads, group, head_dim, dtype=torch.float32, device=q.device)
    # Whole blocks gather fast (contiguous rows); each KV head is then a strided [B, L, D]
    # view that bmm reads in place, so no permute copy is ever made.
    length = num_blocks * block_size
    k = dequantize_kv(k_cache[blocks], k_scale).view(batch, length, num_kv_heads, head_dim)
    v = dequantize_kv(v_cache[blocks], v_scale).view(batch, length, num_kv_heads, head_dim)
    k, v = k.to(torch.float32), v.to(torch.float32)
    v.masked_fill_(invalid[:, :, None, None], 0.0)  # v is a fresh gather: safe in place
    for h in range(num_kv_heads):
        scores = torch.bmm(query[:, h], k[:, :, h].transpose(1, 2)).mul_(scale)
        scores.masked_fill_(invalid[:, None, :], float("-inf"))
        out[:, h] = torch.bmm(F.softmax(scores, dim=-1), v[:, :, h])
    return out.view(batch, num_q_heads, head_dim).to(q.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
             ) -> Tensor | tuple[Tensor, Tensor]:
    """`Qwen3RMSNorm` over the last dim; with `residual`, normalises `x + residual` and returns it too."""
    if residual is not None:
        x = x + residual
        residual = x
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    out = weight * hidden.to(x.dtype)
    return out if residual is None else (out, residual)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor
                     ) -> tuple[Tensor, Tensor]:
    """NeoX/HF rotary embedding `x * cos + rotate_half(x) * sin`, written into `q` and `k` in place."""
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()]
    cos, sin = cos_sin[:, :half], cos_sin[:, half:]
    # HF repeats the frequencies over both halves and casts cos/sin to the activation dtype first.
    cos = torch.cat((cos, cos), dim=-1).to(q.dtype).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).to(q.dtype).unsqueeze(1)
    q.copy_((q * cos) + (_rotate_half(q) * sin))
    k.copy_((k * cos.to(k.dtype)) + (_rotate_half(k) * sin.to(k.dtype)))
    return q, k


def split_qkv(qkv: Tensor, num_q_heads: int, num_kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """Views q `[T, Hq, D]`, k and v `[T, Hkv, D]` of a packed QKV projection `[T, (Hq + 2 Hkv) D]`."""
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_q_heads + 2 * num_kv_heads)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.view(num_tokens, num_q_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))


def qk_norm_rope_write_kv(qkv: Tensor, num_q_heads: int, num_kv_heads: int, q_weight: Tensor,
                          k_weight: Tensor, eps: float, positions: Tensor, cos_sin_cache: Tensor,
                          k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                          k_scale: Tensor | None = None, v_scale: Tensor | None = None
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """Qwen3's attention prologue: per-head RMSNorm of q and k, rotary, K/V stored in the cache.

    q and k are overwritten in place inside `qkv`; returns the views (q, k, v) of `qkv`.
    """
    q, k, v = split_qkv(qkv, num_q_heads, num_kv_heads)
    q_rot, k_rot = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    rotary_embedding(positions, q_rot, k_rot, cos_sin_cache)
    q.copy_(q_rot)
    k.copy_(k_rot)
    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k, v


def silu_and_mul(x: Tensor) -> Tensor:
    """`[..., 2I] -> silu(x[..., :I]) * x[..., I:]` (gate then up, as in a merged gate_up projection)."""
    inter = x.shape[-1] // 2
    # contiguous(): torch's SiLU on a strided view can differ in the last bit from HF's, which
    # applies it to the gate projection's own (contiguous) output.
    return F.silu(x[..., :inter].contiguous()) * x[..., inter:]


# Tokens per chunk of `sample_tokens` (and its Triton twin): the draw finds the chunk first.
SAMPLE_CHUNK = 128
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's constants as torch's (wrapping) int64
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def uniform(rng_key: Tensor, rng_counter: Tensor) -> Tensor:
    """float64 [S] in [0, 1): splitmix64 of (key, counter), its top 53 bits."""
    x = rng_key ^ (rng_counter * _GOLDEN)
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    return _shr(x, 11).to(torch.float64) * 2.0 ** -53


def _chunk_stats(x: Tensor, owned: bool) -> tuple[Tensor, Tensor]:
    """Per chunk of `SAMPLE_CHUNK` columns of float32 `x` [R, N] (N a multiple of the chunk, or
    less: one ragged chunk): its max, and the sum of `exp(x - max)` (0 if all -inf). `owned`:
    `x` may be overwritten."""
    rows, n = x.shape
    x = x.reshape(rows, -1, min(n, SAMPLE_CHUNK))
    cmax = x.amax(dim=-1)
    shift = torch.where(cmax == float("-inf"), 0.0, cmax).unsqueeze(-1)
    w = x.sub_(shift) if owned else x - shift
    return cmax, w.exp_().sum(dim=-1)


def _all_chunk_stats(logits: Tensor, divisor: Tensor | None) -> tuple[Tensor, Tensor]:
    """`_chunk_stats` of every row of `logits / divisor`: float32 [S, num_chunks] each."""
    rows, vocab = logits.shape
    main = vocab - vocab % SAMPLE_CHUNK
    num_chunks = -(-vocab // SAMPLE_CHUNK)
    cmax = torch.empty(rows, num_chunks, device=logits.device)
    csum = torch.empty(rows, num_chunks, device=logits.device)
    # On CPU a few rows at a time (about 4 MiB of float32 per thread): their copy stays in
    # cache and the allocator hands the same heap block back each time, where one [S, V]
    # buffer costs more in first-touch page faults than all the arithmetic. A row's results
    # do not depend on its block.
    step = rows if logits.is_cuda else max(1, (torch.get_num_threads() << 20) // vocab)
    full = slice(0, main // SAMPLE_CHUNK)
    for start in range(0, rows, step):
        part = slice(start, start + step)
        x = _scaled(logits[part], None if divisor is None else divisor[part])
        owned = x.data_ptr() != logits[part].data_ptr()
        if main:
            cmax[part, full], csum[part, full] = _chunk_stats(x[:, :main], owned)
        if main < vocab:  # the ragged last chunk, on its own (no padded copy of the logits)
            cmax[part, -1:], csum[part, -1:] = _chunk_stats(x[:, main:], owned)
    return cmax, csum


def _scaled(logits: Tensor, divisor: Tensor | None) -> Tensor:
    """float32 `logits / divisor[:, None]` (the logits as float32 without a divisor)."""
    if divisor is None:
        return logits.to(torch.float32)
    return torch.div(logits, divisor.unsqueeze(1)).to(torch.float32)


def sample_tokens(logits: Tensor, rng_key: Tensor, rng_counter: Tensor,
                  temperature: Tensor | None = None) -> Tensor:
    """One token per row of `logits` [S, V] (any float dtype, computed in float32): int64 [S].

    A row whose temperature is not > 0 takes its first maximum; any other row draws from
    softmax(logits / temperature) (-inf = excluded; no temperature: the logits come scaled)
    at the uniform `uniform(rng_key, rng_counter)`, by inverse CDF: the chunk of
    `SAMPLE_CHUNK` tokens whose running mass passes the uniform's share of the total, then the
    token inside it. Chunk sums are float32 (each within a few ulps of exact; a token's
    probability is off by that relative error at most); everything across chunks and inside
    the chosen one is float64, so no token's mass is absorbed by a larger one. Only tokens of
    positive probability come out. Nothing syncs with the host or depends on values for its
    shape, and a row's result depends on its own inputs only (never on the other rows).
    """
    rows, vocab = logits.shape
    greedy = divisor = None
    if temperature is not None:
        greedy = ~(temperature > 0)
        divisor = torch.where(greedy, 1.0, temperature)
    cmax, csum = _all_chunk_stats(logits, divisor)
    csum = csum.double()
    num_chunks = cmax.shape[1]
    row_max = cmax.amax(dim=-1, keepdim=True)
    scale = (cmax.double() - row_max.double()).exp()
    mass = torch.where(csum > 0, csum * scale, 0.0)
    cum = mass.cumsum(dim=-1)
    target = uniform(rng_key, rng_counter).unsqueeze(1) * cum[:, -1:]
    idx = torch.arange(num_chunks, device=logits.device)
    last = torch.where(mass > 0, idx, -1).amax(dim=-1, keepdim=True)
    # The uniform's chunk: how many running sums before the last chunk with mass it passes.
    passed = (cum <= target) & (idx < last)
    which = passed.sum(dim=-1, keepdim=True)
    before = torch.where(passed, cum, 0.0).amax(dim=-1, keepdim=True)
    if greedy is not None:
        first_max = torch.where(cmax == row_max, idx, num_chunks - 1).amin(dim=-1, keepdim=True)
        which = torch.where(greedy.unsqueeze(1), first_max, which)
    # Inside the chunk: the token whose running weight passes the rest of the target.
    offs = torch.arange(SAMPLE_CHUNK, device=logits.device)
    cols = which * SAMPLE_CHUNK + offs
    xs = _scaled(logits.gather(1, cols.clamp(max=vocab - 1)), divisor)
    xs.masked_fill_(cols >= vocab, float("-inf"))
    cm = cmax.gather(1, which)
    inside = (xs - torch.where(cm == float("-inf"), 0.0, cm)).exp_().double().cumsum_(dim=-1)
    inside_total = inside[:, -1:]
    # Stay below the chunk's own total (its float sum may round apart from this one), so the
    # lookup lands on a token of positive weight.
    scale = (cm.double() - row_max.double()).exp()
    rest = torch.minimum((target - before) / scale, inside_total - inside_total * 2.0 ** -40)
    offset = (inside <= rest).sum(dim=-1, keepdim=True).clamp_(max=SAMPLE_CHUNK - 1)
    if greedy is not None:
        first = torch.where(xs == row_max, offs, SAMPLE_CHUNK - 1).amin(dim=-1, keepdim=True)
        offset = torch.where(greedy.unsqueeze(1), first, offset)
    return (which * SAMPLE_CHUNK + offset).squeeze(1)
