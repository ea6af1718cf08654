"""The LoRA side of one model shard: its wrappers (workers/lora/layers.py) installed around the
dense decoder layers' projections, the per-step token slots they read, and the device slots'
contents, changed only by the plan's `LoRALoad`s (scheduler/lora.py decides them).

At pipeline_parallel_size > 1 a stage wraps only the layers it holds (workers/pipeline.py), so
its slots hold, and a load copies, only those layers' tensors of an adapter; every stage gets
the same plan, so a slot holds the same adapter on every stage.

Invariants: slot `max_loras` (index -1) of every wrapper is zero; a slot holds exactly one
adapter's tensors, or zeros, in every wrapper at once; `batch.token_slots[:T]` are the step's
tokens' slots before its forward pass (the model runner writes them).
"""

from __future__ import annotations

import torch
from torch import nn

from scheduler.plan import LoRALoad, StepPlan
from workers.lora.layers import (
    BaseLinearWithLoRA,
    ColumnParallelLinearWithLoRA,
    LoRABatch,
    RowParallelLinearWithLoRA,
)

_QKV = [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")]
_GATE_UP = [("gate_proj", 0), ("up_proj", 1)]


def check_lora_plan(plan: StepPlan, max_loras: int) -> None:
    """ValueError for a plan that names LoRA slots a worker with `max_loras` slots lacks."""
    if not plan.new_seqs and not plan.lora_loads:  # (a decode step's: nothing to check)
        return
    bad = next((n for n in plan.new_seqs if not -1 <= n.lora_slot < max_loras), None)
    if bad is not None or (plan.lora_loads and not max_loras):
        what = (f"seq {bad.seq_id} runs in LoRA slot {bad.lora_slot}" if bad is not None
                else "it loads LoRA adapters")
        raise ValueError(f"plan {plan.step_id}: {what}, but this worker has {max_loras} LoRA "
                         "slots (WorkerConfig.max_loras)")


class LoRAModel:
    """Wraps a Qwen3 shard's projections in place; loads adapters into slots."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_tokens: int,
                 backend: str) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        device = next(model.parameters()).device
        self.batch = LoRABatch(torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
                               active=False, backend=backend)
        self.layers: list[tuple[int, BaseLinearWithLoRA]] = []
        for i, layer in enumerate(model.model.layers):
            if not model.stage.holds_layer(i):  # another pipeline stage's: its adapter there
                continue
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = self._wrap(i, ColumnParallelLinearWithLoRA, attn.qkv_proj, _QKV)
            attn.o_proj = self._wrap(i, RowParallelLinearWithLoRA, attn.o_proj, [("o_proj", None)])
            if hasattr(mlp, "gate_up_proj"):  # (a mixture-of-experts block has none)
                mlp.gate_up_proj = self._wrap(i, ColumnParallelLinearWithLoRA, mlp.gate_up_proj,
                                              _GATE_UP)
                mlp.down_proj = self._wrap(i, RowParallelLinearWithLoRA, mlp.down_proj,
                                           [("down_proj", None)])

    def _wrap(self, layer: int, kind: type, base: nn.Module,
              slices: list[tuple[str, int | str | None]]) -> BaseLinearWithLoRA:
        wrapper = kind(base, slices, self.max_loras, self.max_rank, self.batch)
        self.layers.append((layer, wrapper))
        return wrapper

    @property
    def nbytes(self) -> int:
        """Device memory of the slot tensors (counted before the KV cache is sized)."""
        return sum(w.nbytes for _, w in self.layers)

    @property
    def max_tokens(self) -> int:
        return int(self.batch.token_slots.shape[0])

    def load(self, loads: list[LoRALoad]) -> None:
        """Fill each load's slot with its adapter (ValueError for a bad slot or no tensors)."""
        for load in loads:
            if not 0 <= load.slot < self.max_loras:
                raise ValueError(f"LoRALoad names slot {load.slot}; this worker has "
                                 f"{self.max_loras} (max_loras)")
            if load.weights is None:
                raise ValueError(f"LoRALoad of adapter {load.lora_id} carries no weights; the "
                                 "engine attaches them before the plan is sent")
            if load.weights.rank > self.max_rank:
                raise ValueError(f"adapter {load.lora_id} has rank {load.weights.rank}; "
                                 f"max_lora_rank is {self.max_rank}")
            with torch.inference_mode():
                for layer, wrapper in self.layers:
                    wrapper.set_slot(load.slot, layer, load.weights.tensors)
