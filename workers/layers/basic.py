"""RMSNorm, the rotary table and SiLU-and-mul: thin modules over the `kernels` ops."""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import Tensor, nn

import kernels
from workers.layers.weights import default_weight_loader
from workers.model_config import YarnScaling


class RMSNorm(nn.Module):
    """Qwen3RMSNorm; `forward(x, residual)` fuses the residual add and returns (norm, new residual)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 backend: str = "auto") -> None:
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        return kernels.rms_norm(x, self.weight, self.eps, residual, backend=self.backend)


class RotaryEmbedding(nn.Module):
    """NeoX-style RoPE's float32 cos/sin table over every position the model may see; with
    `yarn`, YaRN's frequencies and attention factor (`kernels.compute_cos_sin_cache`).

    The rotation itself runs inside `kernels.qk_norm_rope_write_kv` (Qwen3's attention prologue).
    """

    def __init__(self, head_dim: int, max_position: int, base: float,
                 yarn: YarnScaling | None = None) -> None:
        super().__init__()
        table = kernels.compute_cos_sin_cache(head_dim, max_position, base,
                                              None if yarn is None else asdict(yarn))
        self.register_buffer("cos_sin_cache", table, persistent=False)


class SiluAndMul(nn.Module):
    def __init__(self, backend: str = "auto") -> None:
        super().__init__()
        self.backend = backend

    def forward(self, x: Tensor) -> Tensor:
        return kernels.silu_and_mul(x, backend=self.backend)
