"""Plain-torch batched LoRA (the twin of kernels/triton_lora.py): every token through its own
adapter's slot, for a whole mixed batch in two matmuls, no per-request loop and no host read.

The adapters' weights are stacked by slot: `lora_a [S, R, in]`, `lora_b [S, out, R]`, the last
slot all zeros (the base model's). A token's slot is `token_slots[t]`; -1 indexes that last
slot, so base rows add exactly zero. Shrink computes the token's rows against every slot's A
at once (`x @ A_all^T`, S * R columns) and keeps its own slot's R; expand scatters each row
into its slot's R columns of an `[T, S * R]` matrix and multiplies by every slot's B at once.
The wasted work is (S - 1) / S of two rank-R products, small beside the base layer's GEMM for
the few slots a step holds; the Triton kernels read only the token's own slot.
"""

from __future__ import annotations

import torch
from torch import Tensor


def lora_shrink(x: Tensor, lora_a: Tensor, token_slots: Tensor) -> Tensor:
    """`[T, R]`: row t is `x[t] @ lora_a[token_slots[t]]^T`."""
    num_tokens = x.shape[0]
    slots, rank, _ = lora_a.shape
    xa = (x @ lora_a.reshape(slots * rank, -1).T).view(num_tokens, slots, rank)
    return xa[torch.arange(num_tokens, device=x.device), token_slots[:num_tokens]]


def lora_expand(y: Tensor, lora_b: Tensor, token_slots: Tensor, out: Tensor) -> None:
    """`out[t] += y[t] @ lora_b[token_slots[t]]^T`, in place."""
    num_tokens, rank = y.shape
    slots = lora_b.shape[0]
    spread = y.new_zeros(num_tokens, slots, rank)
    spread[torch.arange(num_tokens, device=y.device), token_slots[:num_tokens]] = y
    b_all = lora_b.permute(1, 0, 2).reshape(lora_b.shape[1], slots * rank)
    out += spread.view(num_tokens, slots * rank) @ b_all.T
