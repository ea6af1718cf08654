"""Plain-torch reference kernels: the CPU path and the oracle every Triton kernel is tested against.

In float32 each function computes exactly what Hugging Face's Qwen3 does (same operations in the
same order: `Qwen3RMSNorm`, `apply_rotary_pos_emb`, `eager_attention_forward`, `Qwen3MLP`), so a
model built on them reproduces transformers' greedy tokens. For fp16/bf16 inputs attention is
computed in float32 and rounded once at the end, which makes it the tighter oracle for the
Triton kernels (they also accumulate in float32).

Cache layout (shared with the Triton kernels): one K and one V tensor per layer, each
`[num_blocks, block_size, num_kv_heads, head_dim]`; token slot `s` lives at
`cache[s // block_size, s % block_size]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
             slot_mapping: Tensor) -> None:
    """Store `key`/`value` `[T, Hkv, D]` at `slot_mapping` `[T]`; slots equal to -1 are skipped."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_k[slots] = key[keep].to(k_cache.dtype)
    flat_v[slots] = value[keep].to(v_cache.dtype)


def gather_kv(cache: Tensor, block_table: Tensor, seq_len: int) -> Tensor:
    """The first `seq_len` token rows `[seq_len, Hkv, D]` of one sequence, read through its block table.

    Only the first ceil(seq_len / block_size) entries of `block_table` are read; the rest is padding.
    """
    block_size = cache.shape[1]
    num_used = -(-seq_len // block_size)
    blocks = block_table[:num_used].long()
    return cache[blocks].reshape(num_used * block_size, *cache.shape[2:])[:seq_len]


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    query_start_loc: Tensor, seq_lens: Tensor, scale: float) -> Tensor:
    """Causal attention of a mixed prefill/decode batch over a paged KV cache.

    Sequence b owns query rows `q[query_start_loc[b]:query_start_loc[b + 1]]`; its last query token
    sits at position `seq_lens[b] - 1` and every query attends the keys at positions <= its own.
    """
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        # [Hq, L, D], repeated per query head the way HF's repeat_kv does it.
        k = gather_kv(k_cache, block_tables[b], seq_len).transpose(0, 1)
        v = gather_kv(v_cache, block_tables[b], seq_len).transpose(0, 1)
        k = k.repeat_interleave(group, dim=0).to(torch.float32)
        v = v.repeat_interleave(group, dim=0).to(torch.float32)
        query = q[q_start:q_end].transpose(0, 1).to(torch.float32)  # [Hq, q_len, D]
        scores = torch.matmul(query, k.transpose(1, 2)) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        masked = k_pos[None, :] > q_pos[:, None]
        scores = scores.masked_fill(masked, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
        out[q_start:q_end] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
    return out


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


def compute_cos_sin_cache(head_dim: int, max_pos: int, base: float) -> Tensor:
    """`[max_pos, head_dim]` float32: cat(cos, sin) of `pos * inv_freq`, each half `[max_pos, head_dim / 2]`."""
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


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


def silu_and_mul(x: Tensor) -> Tensor:
    """`[..., 2I] -> silu(x[..., :I]) * x[..., I:]` (gate then up, as in a merged gate_up projection)."""
    inter = x.shape[-1] // 2
    # contiguous(): torch's SiLU on a strided view can differ in the last bit from HF's, which
    # applies it to the gate projection's own (contiguous) output.
    return F.silu(x[..., :inter].contiguous()) * x[..., inter:]
