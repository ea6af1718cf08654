"""LoRA wrappers of the tensor-parallel linear layers (vLLM's `lora/layers`, smaller): a wrapper
holds the base layer unchanged (`base_layer`, its weights and its way of multiplying are its
own) and adds, for every token, its adapter's `x @ A^T @ B^T` (B pre-scaled,
scheduler/plan.py's LoRAWeights) through the batched kernels (kernels.lora_shrink /
lora_expand), each token reading the slot `LoRABatch.token_slots` gives it.

Slot tensors, per wrapper: `lora_a [max_loras + 1, n * R, in]` and, per slice j,
`lora_b[j] [max_loras + 1, out_j, R]`, with R = max_lora_rank rounded up to a multiple of 8 and
n the packed slices (3 for qkv, 2 for gate_up, else 1); the last slot stays zero (slot -1: the
base model). Slice j's A fills rows [j R, j R + r) of A (r the adapter's rank; the rest zero),
so one shrink serves q, k and v together; each slice's expand adds into its own output rows.
A slice the adapter leaves out is zero.

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
from workers.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
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
        self.batch = batch
        # (a multiple of 8: the grouped GEMMs need rows of 16-byte multiples; the rest is zeros)
        self.rank = rank = -(-max_rank // 8) * 8
        w = base.weight  # (its shape and device; an FP8 weight's dtype is not the activations')
        out, n_in = w.shape
        dtype = base.params_dtype
        self.register_buffer("lora_a", torch.zeros(max_loras + 1, len(slices) * rank, n_in,
                                                   dtype=dtype, device=w.device),
                             persistent=False)
        # each slice's rows of this rank's output, and its B over them
        self.rows = [(0, out) if self.shards_a else _slice_rows(base, sid) for _, sid in slices]
        self.lora_b = [torch.zeros(max_loras + 1, size, rank, dtype=dtype, device=w.device)
                       for _, size in self.rows]

    @property
    def nbytes(self) -> int:
        return self.lora_a.nbytes + sum(b.nbytes for b in self.lora_b)

    def add_lora(self, x: Tensor, out: Tensor) -> Tensor:
        """`out` plus each token's adapter product (in place; nothing when the batch has none):
        one shrink for every slice, one expand per slice into its own rows."""
        batch = self.batch
        if batch.active:
            slots, backend, r = batch.token_slots, batch.backend, self.rank
            y = kernels.lora_shrink(x, self.lora_a, slots, backend=backend)
            for j, (lora_b, (lo, size)) in enumerate(zip(self.lora_b, self.rows)):
                kernels.lora_expand(y[:, j * r:(j + 1) * r], lora_b, slots,
                                    out[:, lo:lo + size], backend=backend)
        return out

    def set_slot(self, slot: int, layer: int, tensors: dict[str, tuple[np.ndarray, np.ndarray]]
                 ) -> None:
        """Put one adapter's tensors for this layer into `slot` (zeros for slices it lacks):
        the sharded one of A and B through the base layer's weight_loader, the other whole."""
        self.lora_a[slot].zero_()
        for j, (module, shard_id) in enumerate(self.slices):
            lora_b = self.lora_b[j][slot]
            lora_b.zero_()
            pair = tensors.get(f"layers.{layer}.{module}")
            if pair is None:
                continue
            a, b = (torch.from_numpy(t) for t in pair)
            r, lo = a.shape[0], j * self.rank
            loader = self.base_layer.weight_loader
            if self.shards_a:  # row-parallel: this rank's input columns of A, all of B
                loader(self.lora_a[slot, lo:lo + r], WeightSource(f"{module}.lora_A", a))
                lora_b[:, :r].copy_(b)
            else:  # column-parallel: all of A, this rank's rows of the slice's B
                self.lora_a[slot, lo:lo + r].copy_(a)
                packed = torch.zeros(self.base_layer.weight.shape[0], r, dtype=lora_b.dtype)
                loader(packed, WeightSource(f"{module}.lora_B", b), shard_id)
                start, size = self.rows[j]
                lora_b[:, :r].copy_(packed[start:start + size])


def _slice_rows(base: LinearBase, shard_id: int | str | None) -> tuple[int, int]:
    """(first row, rows) of a packed slice in this rank's output of a column-parallel layer."""
    if isinstance(base, QKVParallelLinear):
        q, kv = base.q_size, base.kv_size
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
    if isinstance(base, MergedColumnParallelLinear):
        ws = base.tp.world_size
        return sum(base.output_sizes[:shard_id]) // ws, base.output_sizes[shard_id] // ws
    return 0, base.weight.shape[0]


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
