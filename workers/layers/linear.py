"""Tensor-parallel linear layers (Megatron style, nano-vllm's names).

Column-parallel layers split the output features across ranks and need no communication;
row-parallel layers split the input features and all-reduce the partial sums. Each weight
carries a `weight_loader` that reads its rank's shard from the full checkpoint tensor, so
merged (gate_up) and packed (qkv) projections load from their separate checkpoint names.
`matmul(x)` is this rank's product alone, before any communication: what a wrapper around the
layer (LoRA, workers/lora/layers.py) adds to before a row-parallel layer's all-reduce.

How the weights are stored and multiplied is the layer's linear method's
(workers/layers/linear_method.py: unquantized or block-scaled FP8); the layer owns only the
geometry, `_shard(shard_id)`: which rows or columns of a checkpoint tensor this rank keeps and
where they go. A block-scaled weight's scales load through the same geometry counted in blocks
(`weight_loader(..., block=(bn, bk))`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor, nn

from workers.distributed import TensorParallelGroup
from workers.layers.linear_method import make_linear_method
from workers.layers.weights import WeightSource, copy_checked
from workers.quantization import Fp8Config

# (dim, offset in this rank's parameter, start in the full checkpoint tensor, length)
Shard = tuple[int, int, int, int]


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size="
                         f"{denominator}; choose a tensor_parallel_size that divides it")
    return numerator // denominator


class LinearBase(nn.Module, ABC):
    """`y = x @ W.T` with `W` [output_size, input_size] of this rank's shard (no bias: Qwen3 has
    none); `output_partition_sizes` are the packed parts of this rank's output rows;
    `input_is_split`: the ranks split the input features (row-parallel), else the output's."""

    input_is_split = False

    def __init__(self, input_size: int, output_partition_sizes: list[int],
                 tp: TensorParallelGroup, dtype: torch.dtype,
                 quant: Fp8Config | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.params_dtype = dtype  # activations' (and LoRA's) dtype, whatever W is stored in
        self.quant_method = make_linear_method(quant)
        self.quant_method.create_weights(self, output_partition_sizes, input_size, dtype)

    @abstractmethod
    def _shard(self, shard_id: int | str | None, name: str) -> Shard:
        """Where this rank's slice of checkpoint tensor `name` (part `shard_id`) goes."""

    def weight_loader(self, param: Tensor, loaded: WeightSource,
                      shard_id: int | str | None = None,
                      block: tuple[int, int] | None = None) -> None:
        """Copy this rank's slice of the full checkpoint tensor `loaded` into `param`; with
        `block`, `param` and `loaded` are per-block scales and the slice is counted in blocks."""
        dim, offset, start, length = self._shard(shard_id, loaded.name)
        if block is not None:  # offsets are whole blocks; a last partial block counts as one
            b = block[dim]
            offset, start, length = offset // b, start // b, -(-length // b)
        copy_checked(param.data.narrow(dim, offset, length), loaded.narrow(dim, start, length),
                     loaded.name)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def matmul(self, x: Tensor) -> Tensor:
        """This rank's `x @ W.T` (a row-parallel layer's partial sum, not yet reduced)."""
        return self.quant_method.apply(self, x)

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x)


class ColumnParallelLinear(LinearBase):
    """Output features split evenly over the ranks: rank r holds rows [r*n, (r+1)*n) of W."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallelGroup,
                 dtype: torch.dtype, quant: Fp8Config | None = None) -> None:
        self.output_size_per_partition = _divide(output_size, tp.world_size, "output_size")
        super().__init__(input_size, self._partitions(tp.world_size), tp, dtype, quant)

    def _partitions(self, world_size: int) -> list[int]:
        return [self.output_size_per_partition]

    def _shard(self, shard_id: int | str | None, name: str) -> Shard:
        n = self.output_size_per_partition
        return 0, 0, self.tp.rank * n, n


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up); shard_id picks the part."""

    def __init__(self, input_size: int, output_sizes: list[int], tp: TensorParallelGroup,
                 dtype: torch.dtype, quant: Fp8Config | None = None) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), tp, dtype, quant)

    def _partitions(self, world_size: int) -> list[int]:
        return [size // world_size for size in self.output_sizes]

    def _shard(self, shard_id: int | str | None, name: str) -> Shard:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{name}: merged shard id must be in "
                             f"[0, {len(self.output_sizes)}); got {shard_id!r}")
        ws = self.tp.world_size
        size = self.output_sizes[shard_id] // ws
        return 0, sum(self.output_sizes[:shard_id]) // ws, self.tp.rank * size, size


class QKVParallelLinear(ColumnParallelLinear):
    """Packed q, k, v projections; query heads split over the ranks, KV heads split or replicated.

    With tp > num_kv_heads each rank holds one KV head, `rank // (tp // num_kv_heads)`: the
    head Hugging Face's grouping assigns to this rank's query heads.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, tp: TensorParallelGroup, dtype: torch.dtype,
                 quant: Fp8Config | None = None) -> None:
        ws = tp.world_size
        self.head_dim = head_dim
        self.total_num_kv_heads = total_num_kv_heads
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
        self.output_size_per_partition = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, [self.q_size, self.kv_size, self.kv_size], tp,
                            dtype, quant)

    def _shard(self, shard_id: int | str | None, name: str) -> Shard:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id == "k":
            offset, size = self.q_size, self.kv_size
            start = self.kv_head_start * self.head_dim
        elif shard_id == "v":
            offset, size = self.q_size + self.kv_size, self.kv_size
            start = self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"{name}: qkv shard id must be 'q', 'k' or 'v'; got {shard_id!r}")
        return 0, offset, start, size


class RowParallelLinear(LinearBase):
    """Input features split over the ranks; the partial products are all-reduced."""

    input_is_split = True

    def __init__(self, input_size: int, output_size: int, tp: TensorParallelGroup,
                 dtype: torch.dtype, quant: Fp8Config | None = None) -> None:
        self.input_size_per_partition = _divide(input_size, tp.world_size, "input_size")
        super().__init__(self.input_size_per_partition, [output_size], tp, dtype, quant)

    def _shard(self, shard_id: int | str | None, name: str) -> Shard:
        n = self.input_size_per_partition
        return 1, 0, self.tp.rank * n, n

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.all_reduce(self.matmul(x))
