"""Block-scaled FP8 weights (Qwen's / DeepSeek's format) and the torch twin of their GEMM.

Format: a weight `W [N, K]` is stored as float8 e4m3 `Wq` with one float32 `weight_scale_inv`
per `[bn, bk]` block (a grid of `[ceil(N / bn), ceil(K / bk)]`), so that
`W ~= Wq * scale_inv[n // bn, k // bk]`; a block's scale is its absolute maximum over 448,
e4m3's largest finite value, so no value saturates.

The GEMMs (dense, and the fused MoE experts' two) are W8A8: activations are quantized on the
fly per token and per group of `bk` columns (one scale per row and group, `amax / 448`), so each `bk`-wide step of the product is
an e4m3 x e4m3 dot product times one activation scale and one weight scale. The twin does that
arithmetic in float32 (quantize, dequantize, matmul); the Triton kernel (kernels/triton_fp8.py)
accumulates the same products in float32 registers.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The smallest scale a group of zeros gets (any positive value keeps 0 / scale = 0).
MIN_SCALE = 1e-10 / FP8_MAX


def _expand(scale: Tensor, block: tuple[int, int], shape: tuple[int, int]) -> Tensor:
    """A per-block `[ceil(N/bn), ceil(K/bk)]` grid repeated to `[N, K]` (edge blocks cut)."""
    bn, bk = block
    return scale.repeat_interleave(bn, 0)[:shape[0]].repeat_interleave(bk, 1)[:, :shape[1]]


def quantize_weight_blocks(weight: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """(`Wq` e4m3 `[N, K]`, `scale_inv` float32 `[ceil(N/bn), ceil(K/bk)]`) of a float weight."""
    if weight.dim() != 2:
        raise ValueError(f"a block-quantized weight must be 2-D [N, K]; got {tuple(weight.shape)}")
    n, k = weight.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    amax = padded.view(gn, bn, gk, bk).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    q = (weight.float() / _expand(scale, block, (n, k))).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_weight_blocks(weight: Tensor, scale_inv: Tensor, block: tuple[int, int],
                             dtype: torch.dtype = torch.float32) -> Tensor:
    """`Wq * scale_inv` per block, in `dtype` (`[N, K]`, or `[E, N, K]` with `[E, gn, gk]`)."""
    if weight.dim() == 3:
        return torch.stack([dequantize_weight_blocks(w, s, block, dtype)
                            for w, s in zip(weight, scale_inv)])
    shape = (weight.shape[0], weight.shape[1])
    return (weight.float() * _expand(scale_inv.float(), block, shape)).to(dtype)


def dequantized_weight(weight: Tensor, scale_inv: Tensor, block: tuple[int, int],
                       dtype: torch.dtype, made: Tensor | None) -> Tensor:
    """`dequantize_weight_blocks(weight, scale_inv, block, dtype)`, or `made` when given (that
    tensor made once beforehand: a CPU layer keeps it from load), checked to fit."""
    if made is None:
        return dequantize_weight_blocks(weight, scale_inv, block, dtype)
    if made.shape != weight.shape or made.dtype != dtype:
        raise ValueError(f"dequantized must be the weight's shape {tuple(weight.shape)} in "
                         f"{dtype}; got {tuple(made.shape)} in {made.dtype}")
    return made


def quantize_act_groups(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """(`xq` e4m3 `[M, K]`, scales float32 `[M, ceil(K / group)]`): each row's groups of
    `group` columns over their own absolute maximum / 448."""
    m, k = x.shape
    g = -(-k // group)
    padded = torch.zeros(m, g * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    scale = (padded.view(m, g, group).abs().amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE)
    full = scale.repeat_interleave(group, 1)[:, :k]
    return (x.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fake_quantize_act_groups(x: Tensor, group: int) -> Tensor:
    """`x [M, K]` as the W8A8 GEMMs see it: quantized per row and `group` columns
    (`quantize_act_groups`) and dequantized again, in float32."""
    xq, xs = quantize_act_groups(x, group)
    return xq.float() * xs.repeat_interleave(group, 1)[:, :x.shape[1]]


def fp8_block_linear(x: Tensor, weight: Tensor, weight_scale_inv: Tensor,
                     block: tuple[int, int], dequantized: Tensor | None = None) -> Tensor:
    """`x [M, K] @ W.T` with `W` block-quantized and `x` quantized per token and `bk` group:
    `[M, N]` in x's dtype, accumulated in float32. `dequantized`: the weight's
    `dequantize_weight_blocks` made once beforehand (a CPU layer keeps it from load), else made
    here on every call; the same tensor either way, so the same result."""
    w = dequantized_weight(weight, weight_scale_inv, block, torch.float32, dequantized)
    return (fake_quantize_act_groups(x, block[1]) @ w.T).to(x.dtype)
