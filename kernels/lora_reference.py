"""Plain-torch batched LoRA (the twin of kernels/triton_lora.py), Punica's SGMV in torch: the
tokens are grouped by adapter slot (once per step: every product of the step groups the same
slots) and each group multiplies by its own slot's A or B in one
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

# The grouping of the last token_slots seen: every LoRA product of a step (11 per decoder layer)
# groups the same slots, so it is computed once per step. Keyed by the tensor's storage and
# version counter (an in-place write of new slots bumps it); inference tensors, which keep no
# version counter, are grouped every time.
_last: tuple[tuple, tuple[Tensor, Tensor, Tensor]] | None = None


def _groups(token_slots: Tensor, num_tokens: int, num_slots: int
            ) -> tuple[Tensor, Tensor, Tensor]:
    """(token order grouped by slot, int32 end of each slot's group, inverse of the order)."""
    global _last
    try:
        key = (token_slots.data_ptr(), token_slots._version, num_tokens, num_slots,
               token_slots.device)
    except RuntimeError:  # an inference tensor
        key = None
    if key is not None and _last is not None and _last[0] == key:
        return _last[1]
    slots = token_slots[:num_tokens]
    group = torch.where(slots >= 0, slots, num_slots - 1)
    order = torch.argsort(group, stable=True)
    counts = torch.zeros(num_slots, dtype=torch.int64, device=slots.device)
    counts.scatter_add_(0, group, torch.ones_like(group))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(num_tokens, device=slots.device)
    groups = order, torch.cumsum(counts, 0).to(torch.int32), inverse
    if key is not None:
        _last = key, groups
    return groups


def lora_shrink(x: Tensor, lora_a: Tensor, token_slots: Tensor) -> Tensor:
    """`[T, R]`: row t is `x[t] @ lora_a[token_slots[t]]^T`."""
    order, ends, inverse = _groups(token_slots, x.shape[0], lora_a.shape[0])
    grouped = F.grouped_mm(x.index_select(0, order), lora_a.transpose(1, 2), offs=ends)
    return grouped.index_select(0, inverse)


def lora_expand(y: Tensor, lora_b: Tensor, token_slots: Tensor, out: Tensor) -> None:
    """`out[t] += y[t] @ lora_b[token_slots[t]]^T`, in place."""
    order, ends, inverse = _groups(token_slots, y.shape[0], lora_b.shape[0])
    grouped = F.grouped_mm(y.index_select(0, order), lora_b.transpose(1, 2), offs=ends)
    out.add_(grouped.index_select(0, inverse))
