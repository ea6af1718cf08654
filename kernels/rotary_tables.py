"""The rotary embedding's cos/sin table: plain RoPE's, or YaRN's (arXiv 2309.00071).

Built once per model (workers/layers/basic.py `RotaryEmbedding`) and read by every rotary
kernel (`reference.rotary_embedding`, the Triton prologue) by position. The arithmetic is
transformers' own, step for step in float32 (`Qwen3RotaryEmbedding`, `_compute_yarn_parameters`),
so the tables are bit-identical to the ones transformers builds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def compute_cos_sin_cache(head_dim: int, max_pos: int, base: float,
                          yarn: Mapping[str, Any] | None = None) -> Tensor:
    """`[max_pos, head_dim]` float32: cat(cos, sin) of `pos * inv_freq`, each half `[max_pos, head_dim / 2]`.

    `yarn` (transformers' rope_parameters keys: factor, original_max_position_embeddings and
    optionally beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, truncate): YaRN's
    frequencies, and cos and sin times its attention factor, as transformers'
    `_compute_yarn_parameters` and `Qwen3RotaryEmbedding` compute them.
    """
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    if yarn is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scale = 1.0
    else:
        inv_freq, scale = _yarn_inv_freq(head_dim, base, yarn)
    freqs = torch.arange(max_pos, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)


def _yarn_inv_freq(dim: int, base: float, yarn: Mapping[str, Any]) -> tuple[Tensor, float]:
    """YaRN (arXiv 2309.00071): dimensions that rotate more than beta_fast times over the
    original context keep their frequency, those under beta_slow are divided by `factor`, a
    linear ramp between; (inv_freq, attention factor). Same float32 steps as transformers."""
    factor = yarn["factor"]
    original = yarn["original_max_position_embeddings"]
    attention_factor = yarn.get("attention_factor")
    mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        attention_factor = (float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
                            if mscale and mscale_all_dim else get_mscale(factor))
    beta_fast, beta_slow = yarn.get("beta_fast") or 32, yarn.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor
