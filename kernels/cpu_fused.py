"""The small ops of a Qwen3 layer on CPU, with fewer torch calls than their reference twins.

What `backend="auto"` runs for CPU tensors (`kernels.ops`) for the attention prologue
(`qk_norm_rope_write_kv`), RMSNorm with and without the residual add, and SiLU-and-mul. The
plain-torch twins in `kernels/reference.py` (Hugging Face's operations in its order) stay the
oracle and are what `backend="torch"` runs; each function here does the same floating-point
operations on every element, in the same order and dtypes, so its results are bit-identical
to the twin's (tests/kernels/test_cpu_fused.py), and greedy parity with transformers carries
over unchanged. What is saved is calls, copies and allocations around the math, which at a
decode step's few rows cost more than the math:
- q and k are normed, rotated and written back as one `[T, Hq + Hkv, D]` view of the QKV
  output (the twin does each separately, with two copies back per tensor);
- the rotary cos/sin rows of the step's positions, cast to the activation dtype, and
  `write_kv`'s cache slots are made once per step into the metadata's `step_cache` and reused
  by every layer (the twin indexes the table and filters the slot mapping in every layer);
- RMSNorm and SiLU-and-mul finish in place on the tensors they allocated themselves.

Invariants:
- Inputs are never written except where the twin writes them (`qkv`'s q and k parts, the
  caches at the mapped slots).
- A `step_cache` entry is used only with the very tensors it was made from (checked by
  identity: the positions, the slot mapping, the cos/sin table), so a second model sharing a
  step's metadata with other positions (a draft model) makes its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import reference
from kernels.reference import quantize_kv, split_qkv


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
             ) -> Tensor | tuple[Tensor, Tensor]:
    """`reference.rms_norm`, bit for bit: `weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)`
    with `h = x (+ residual)` in float32."""
    if residual is not None:
        x = x + residual
    hidden = x.to(torch.float32)
    scale = hidden.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    # fp32: `hidden` is x itself (the residual returned), so the product is a new tensor.
    normed = hidden.mul_(scale) if hidden is not x else hidden * scale
    out = normed.to(x.dtype) if normed.dtype != x.dtype else normed
    out.mul_(weight)  # (weight * h == h * weight: one rounding, either order)
    return out if residual is None else (out, x)


def silu_and_mul(x: Tensor) -> Tensor:
    """`reference.silu_and_mul`, bit for bit: SiLU on a contiguous copy of the gate half (as
    the twin), in place, times the up half in place."""
    inter = x.shape[-1] // 2
    gate = x[..., :inter].contiguous()
    return F.silu(gate, inplace=True).mul_(x[..., inter:])


def _cos_sin(positions: Tensor, cos_sin_cache: Tensor, dtype: torch.dtype,
             step_cache: dict | None) -> tuple[Tensor, Tensor]:
    """The rotary (cos, sin) `[T, 1, D]` of `positions`, in `dtype`, as `reference.
    rotary_embedding` makes them; once per step when a step cache is given."""
    key = ("cpu_fused.cos_sin", dtype)
    hit = None if step_cache is None else step_cache.get(key)
    if hit is not None and hit[0] is positions and hit[1] is cos_sin_cache:
        return hit[2], hit[3]
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()]
    cos = torch.cat((cos_sin[:, :half], cos_sin[:, :half]), dim=-1).to(dtype).unsqueeze(1)
    sin = torch.cat((cos_sin[:, half:], cos_sin[:, half:]), dim=-1).to(dtype).unsqueeze(1)
    if step_cache is not None:
        step_cache[key] = (positions, cos_sin_cache, cos, sin)
    return cos, sin


def _kept_slots(slot_mapping: Tensor, step_cache: dict | None) -> tuple[Tensor, Tensor | None]:
    """(the cache slots written, long; the token rows that write them, None for all):
    `slot_mapping`'s entries that are not -1, once per step when a step cache is given."""
    key = "cpu_fused.slots"
    hit = None if step_cache is None else step_cache.get(key)
    if hit is not None and hit[0] is slot_mapping:
        return hit[1], hit[2]
    keep = slot_mapping >= 0
    if bool(keep.all()):
        slots, rows = slot_mapping.long(), None
    else:
        rows = keep.nonzero().flatten()
        slots = slot_mapping.index_select(0, rows).long()
    if step_cache is not None:
        step_cache[key] = (slot_mapping, slots, rows)
    return slots, rows


def qk_norm_rope_write_kv(qkv: Tensor, num_q_heads: int, num_kv_heads: int, q_weight: Tensor,
                          k_weight: Tensor, eps: float, positions: Tensor, cos_sin_cache: Tensor,
                          k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                          k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                          step_cache: dict | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`reference.qk_norm_rope_write_kv`, bit for bit (q and k normed and rotated in place
    inside `qkv`, K/V stored at the mapped slots); returns the views (q, k, v) of `qkv`.
    `step_cache`: the step's `AttentionMetadata.step_cache` (cos/sin rows and slots made once)."""
    q, k, v = split_qkv(qkv, num_q_heads, num_kv_heads)
    num_tokens, head_dim = qkv.shape[0], q.shape[2]
    qk = qkv[:, :(num_q_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_q_heads + num_kv_heads, head_dim)
    # Per-head RMSNorm of q and k at once (the twin's rms_norm, row by row the same sums).
    hidden = qk.to(torch.float32)
    scale = hidden.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    normed = (hidden * scale).to(qkv.dtype)
    normed[:, :num_q_heads].mul_(q_weight)
    normed[:, num_q_heads:].mul_(k_weight)
    # NeoX rotary: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).
    cos, sin = _cos_sin(positions, cos_sin_cache, qkv.dtype, step_cache)
    half = head_dim // 2
    rotated = torch.cat((-normed[..., half:], normed[..., :half]), dim=-1).mul_(sin)
    qk.copy_(normed.mul_(cos).add_(rotated))
    slots, rows = _kept_slots(slot_mapping, step_cache)
    for cache, rows_in, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        stored = quantize_kv(rows_in if rows is None else rows_in.index_select(0, rows),
                             cache.dtype, scale)
        flat = cache.view(-1, num_kv_heads, head_dim)
        if cache.dtype == reference.FP8_KV_DTYPE:  # (no index_copy_ for float8: its bytes)
            flat, stored = flat.view(torch.uint8), stored.view(torch.uint8)
        flat.index_copy_(0, slots, stored)
    return q, k, v
