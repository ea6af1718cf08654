"""LoRA wrappers of the tensor-parallel linear layers (vLLM's `lora/layers`, smaller): a wrapper
holds the base layer unchanged (`base_layer`, its weights and its way of multiplying are its
own) and adds, for every token, its adapter's `x @ A^T @ B^T` (B pre-scaled,
scheduler/plan.py's LoRAWeights) through the batched kernels (kernels.lora_shrink /
lora_expand), each token reading the slot `LoRABatch.token_slots` gives it.

Slot tensors, per wrapper: `lora_a [max_loras + 1, W, in]`, `lora_b [max_loras + 1, out, W]`
with W = n * R rounded up to a multiple of 8 (R = max_lora_rank, n the packed slices: 3 for
qkv, 2 for gate_up, else 1); the last slot stays zero (slot -1: the base model). A packed layer is one LoRA of rank n * R whose B is
block-diagonal: slice j's A fills rows [j R, j R + r) of A and its B those columns of the
slice's own output rows, so one shrink and one expand serve q, k and v together, and a
slice the adapter leaves out is zero.

Sharding follows the base layer, through the base layer's own `weight_loader`:
column-parallel layers split B by output rows (A whole); row-parallel layers split A by
input columns (B whole) and add the partial `(x_r A_r^T) B^T` before the all-reduce, whose
sum over ranks is `(x A^T) B^T`; the all-reduce itself is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

import kernels
from workers.layers.linear import LinearBase
from workers.layers.weights import WeightSource


@dataclass(slots=True)
class LoRABatch:
    """What every wrapper of one model reads per step: each token's slot, in a persistent
    buffer (fixed storage, so a captured CUDA graph reads the current step's), and whether
    any token of an eager step has an adapter (None in a batch: the wrappers add nothing)."""

    token_slots: Tensor  # int64 [max tokens per step]; -1: the base model
    active: bool
    backend: str


class BaseLinearWithLoRA(nn.Module):
    """A base linear layer plus per-token LoRA; `slices` are (PEFT module name, shard id).
    `shards_a`: whether A is split like the base layer's input (row-parallel) rather than B
    like its output (column-parallel); the other one is whole on every rank."""

    shards_a = False

    def __init__(self, base: LinearBase, slices: list[tuple[str, int | str | None]],
                 max_loras: int, max_rank: int, batch: LoRABatch) -> None:
        super().__init__()
        self.base_layer = base
        self.slices = slices
        self.max_rank = max_rank
        self.batch = batch
        # (a multiple of 8: the grouped GEMMs need rows of 16-byte multiples; the rest is zeros)
        width = -(-len(slices) * max_rank // 8) * 8
        w = base.weight
        out, n_in = w.shape
        self.register_buffer("lora_a", torch.zeros(max_loras + 1, width, n_in, dtype=w.dtype,
                                                   device=w.device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras + 1, out, width, dtype=w.dtype,
                                                   device=w.device), persistent=False)

    def add_lora(self, x: Tensor, out: Tensor) -> Tensor:
        """`out` plus each token's adapter product (in place; nothing when the batch has none)."""
        batch = self.batch
        if batch.active:
            y = kernels.lora_shrink(x, self.lora_a, batch.token_slots, backend=batch.backend)
            kernels.lora_expand(y, self.lora_b, batch.token_slots, out, backend=batch.backend)
        return out

    def set_slot(self, slot: int, layer: int, tensors: dict[str, tuple[np.ndarray, np.ndarray]]
                 ) -> None:
        """Put one adapter's tensors for this layer into `slot` (zeros for slices it lacks):
        the sharded one of A and B through the base layer's weight_loader, the other whole."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for j, (module, shard_id) in enumerate(self.slices):
            pair = tensors.get(f"layers.{layer}.{module}")
            if pair is None:
                continue
            a, b = (torch.from_numpy(t) for t in pair)
            r, lo = a.shape[0], j * self.max_rank
            sharded, whole = ((a, self.lora_a[slot, lo:lo + r]), (b, self.lora_b[slot, :, lo:lo + r]))
            if not self.shards_a:
                sharded, whole = whole, sharded
            self.base_layer.weight_loader(sharded[1], WeightSource(f"{module}.lora", sharded[0]),
                                          shard_id)
            whole[1].copy_(whole[0])


class ColumnParallelLinearWithLoRA(BaseLinearWithLoRA):
    """Column-parallel (and merged / packed qkv): A whole, B by this rank's output rows."""

    def forward(self, x: Tensor) -> Tensor:
        return self.add_lora(x, self.base_layer(x))


class RowParallelLinearWithLoRA(BaseLinearWithLoRA):
    """Row-parallel: A by this rank's input columns, B whole, added before the all-reduce."""

    shards_a = True

    def forward(self, x: Tensor) -> Tensor:
        base = self.base_layer
        return base.tp.all_reduce(self.add_lora(x, base.matmul(x)))
