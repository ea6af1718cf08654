"""Tensor-parallel linear layers (Megatron style, nano-vllm's names).

Column-parallel layers split the output features across ranks and need no communication;
row-parallel layers split the input features and all-reduce the partial sums. Each weight
carries a `weight_loader` that reads its rank's shard from the full checkpoint tensor, so
merged (gate_up) and packed (qkv) projections load from their separate checkpoint names.
`matmul(x)` is this rank's product alone, before any communication: what a wrapper around the
layer (LoRA, workers/lora/layers.py) adds to before a row-parallel layer's all-reduce.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.distributed import TensorParallelGroup
from workers.layers.weights import WeightSource, copy_checked


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size="
                         f"{denominator}; choose a tensor_parallel_size that divides it")
    return numerator // denominator


class LinearBase(nn.Module, ABC):
    """`y = x @ W.T` with `W` [output_size, input_size] of this rank's shard (no bias: Qwen3 has none)."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallelGroup,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @abstractmethod
    def weight_loader(self, param: nn.Parameter, loaded: WeightSource,
                      shard_id: int | str | None = None) -> None:
        """Copy this rank's slice of the full checkpoint tensor `loaded` into `param`."""

    def matmul(self, x: Tensor) -> Tensor:
        """This rank's `x @ W.T` (a row-parallel layer's partial sum, not yet reduced)."""
        return F.linear(x, self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x)


class ColumnParallelLinear(LinearBase):
    """Output features split evenly over the ranks: rank r holds rows [r*n, (r+1)*n) of W."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallelGroup,
                 dtype: torch.dtype) -> None:
        super().__init__(input_size, _divide(output_size, tp.world_size, "output_size"), tp, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: WeightSource,
                      shard_id: int | str | None = None) -> None:
        n = param.shape[0]
        copy_checked(param, loaded.narrow(0, self.tp.rank * n, n), loaded.name)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up); shard_id picks the part."""

    def __init__(self, input_size: int, output_sizes: list[int], tp: TensorParallelGroup,
                 dtype: torch.dtype) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), tp, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: WeightSource,
                      shard_id: int | str | None = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{loaded.name}: merged shard id must be in "
                             f"[0, {len(self.output_sizes)}); got {shard_id!r}")
        ws = self.tp.world_size
        offset = sum(self.output_sizes[:shard_id]) // ws
        size = self.output_sizes[shard_id] // ws
        copy_checked(param.data.narrow(0, offset, size),
                     loaded.narrow(0, self.tp.rank * size, size), loaded.name)


class QKVParallelLinear(ColumnParallelLinear):
    """Packed q, k, v projections; query heads split over the ranks, KV heads split or replicated.

    With tp > num_kv_heads each rank holds one KV head, `rank // (tp // num_kv_heads)`: the
    head Hugging Face's grouping assigns to this rank's query heads.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        ws = tp.world_size
        self.head_dim = head_dim
        self.num_heads = _divide(total_num_heads, ws, "num_attention_heads")
        if ws >= total_num_kv_heads:
            if ws % total_num_kv_heads:
                raise ValueError(f"tensor_parallel_size={ws} is larger than num_key_value_heads="
                                 f"{total_num_kv_heads} but not a multiple of it, so KV heads "
                                 "cannot be replicated evenly; choose another tensor_parallel_size")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank // (ws // total_num_kv_heads)
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, ws, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        output = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, output, tp, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: WeightSource,
                      shard_id: int | str | None = None) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id == "k":
            offset, size = self.q_size, self.kv_size
            start = self.kv_head_start * self.head_dim
        elif shard_id == "v":
            offset, size = self.q_size + self.kv_size, self.kv_size
            start = self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"{loaded.name}: qkv shard id must be 'q', 'k' or 'v'; got {shard_id!r}")
        copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, start, size), loaded.name)


class RowParallelLinear(LinearBase):
    """Input features split over the ranks; the partial products are all-reduced."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallelGroup,
                 dtype: torch.dtype) -> None:
        super().__init__(_divide(input_size, tp.world_size, "input_size"), output_size, tp, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: WeightSource,
                      shard_id: int | str | None = None) -> None:
        n = param.shape[1]
        copy_checked(param, loaded.narrow(1, self.tp.rank * n, n), loaded.name)

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.all_reduce(self.matmul(x))
