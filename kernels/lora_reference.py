"""Plain-torch batched LoRA (the twin of kernels/triton_lora.py), Punica's SGMV in torch: the
tokens are grouped by adapter slot and each group multiplies by its own slot's A or B in one
`torch.nn.functional.grouped_mm`, so a token reads only its own adapter, with no per-request
loop and no host read (the groups' ends stay on the device).

The adapters' weights are stacked by slot: `lora_a [S, R, in]`, `lora_b [S, out, R]`, the last
slot all zeros (the base model's). A token's slot is `token_slots[t]`; -1 is that last slot,
so base rows add exactly zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _groups(token_slots: Tensor, num_tokens: int, num_slots: int) -> tuple[Tensor, Tensor]:
    """(token order grouped by slot, int32 end of each slot's group)."""
    slots = token_slots[:num_tokens]
    key = torch.where(slots >= 0, slots, num_slots - 1)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_slots, dtype=torch.int64, device=slots.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    return order, torch.cumsum(counts, 0).to(torch.int32)


def lora_shrink(x: Tensor, lora_a: Tensor, token_slots: Tensor) -> Tensor:
    """`[T, R]`: row t is `x[t] @ lora_a[token_slots[t]]^T`."""
    num_tokens = x.shape[0]
    order, ends = _groups(token_slots, num_tokens, lora_a.shape[0])
    grouped = F.grouped_mm(x[order], lora_a.transpose(1, 2), offs=ends)
    y = torch.empty_like(grouped)
    y[order] = grouped
    return y


def lora_expand(y: Tensor, lora_b: Tensor, token_slots: Tensor, out: Tensor) -> None:
    """`out[t] += y[t] @ lora_b[token_slots[t]]^T`, in place."""
    order, ends = _groups(token_slots, y.shape[0], lora_b.shape[0])
    out.index_add_(0, order, F.grouped_mm(y[order], lora_b.transpose(1, 2), offs=ends))
