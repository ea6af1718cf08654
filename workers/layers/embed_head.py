"""Vocab-parallel embedding and LM head: each rank holds ceil(vocab / tp) rows of the table.

The last rank's rows past the real vocabulary are zero padding. The embedding sums the
ranks' partial lookups with an all-reduce; the LM head gathers the logit shards to rank 0,
which alone samples (a step whose rows are all plain greedy gathers only each shard's top
value and id instead: `greedy_tokens`, workers/sampler.py `greedy_over_shards`). On CPU a
bf16 LM head, or an fp32 one of a tp-2 half of qwen3-tiny's size and up, multiplies a copy of
its rows packed once after loading for oneDNN, and a narrow fp32 one a transposed copy too for
one row (kernels/cpu_linear.py says which); its `weight` (maybe the embedding's) stays as
loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kernels
from workers.distributed import TensorParallelGroup
from workers.layers.weights import WeightSource, copy_checked
from workers.sampler import greedy_over_shards


class VocabParallelEmbedding(nn.Module):
    """Rank r owns token ids [r * n, (r + 1) * n), n = ceil(vocab_size / tp)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // tp.world_size)
        self.vocab_start_idx = self.num_embeddings_per_partition * tp.rank
        self.vocab_end_idx = min(self.vocab_start_idx + self.num_embeddings_per_partition,
                                 num_embeddings)
        self.weight = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, embedding_dim,
                                               dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: WeightSource,
                      shard_id: int | str | None = None) -> None:
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"{loaded.name} has {loaded.shape[0]} rows; config.json says "
                             f"vocab_size={self.num_embeddings}")
        n = self.vocab_end_idx - self.vocab_start_idx
        copy_checked(param.data.narrow(0, 0, n), loaded.narrow(0, self.vocab_start_idx, n),
                     loaded.name)

    def forward(self, x: Tensor) -> Tensor:
        if self.tp.world_size == 1:
            return F.embedding(x, self.weight)
        mask = (x >= self.vocab_start_idx) & (x < self.vocab_end_idx)
        y = F.embedding((x - self.vocab_start_idx) * mask, self.weight)
        y = y * mask.unsqueeze(-1).to(y.dtype)
        return self.tp.all_reduce(y)


# Up to this many rows the CPU LM head computes W x^T (see ParallelLMHead.forward).
CPU_WXT_MAX_ROWS = 8


class ParallelLMHead(VocabParallelEmbedding):
    """Logits `[N, vocab_size]` on rank 0 (None elsewhere); may share its weight with the embedding."""

    weight_packed: Tensor | None = None
    weight_t: Tensor | None = None  # `[blocks, hidden, cols]`, for one-row products on CPU

    def process_weights_after_loading(self) -> None:
        self.weight_packed = kernels.pack_linear_weight(self.weight.data)
        self.weight_t = kernels.transpose_linear_weight(self.weight.data)

    def forward(self, x: Tensor) -> Tensor | None:  # type: ignore[override]
        logits = self._product(x)
        if self.tp.world_size == 1:
            return logits
        full = self.tp.gather_last_dim(logits)
        return full[:, :self.num_embeddings] if full is not None else None

    def greedy_tokens(self, x: Tensor) -> Tensor | None:
        """Greedy token ids `[N]` on rank 0 (None elsewhere): each rank's argmax over its
        vocabulary shard (padding columns cut), no logits gathered (`greedy_over_shards`)."""
        logits = self._product(x)
        n = self.vocab_end_idx - self.vocab_start_idx
        return greedy_over_shards(logits if n == logits.shape[1] else logits[:, :n],
                                  self.vocab_start_idx, self.tp)

    def _product(self, x: Tensor) -> Tensor:
        """`x W^T` over this rank's rows of the table, `[N, num_embeddings_per_partition]`."""
        if self.weight_packed is not None:
            # oneDNN on the packed rows beat both forms below at every row count in bf16; in
            # fp32 one row takes MKL's GEMV over the transposed copy, more the packed rows (at
            # exactly two, W x^T was ~20 % ahead on one thread, behind on two: not split out).
            return kernels.linear(x, self.weight, self.weight_packed, self.weight_t)
        if x.device.type == "cpu" and x.shape[0] <= CPU_WXT_MAX_ROWS:
            # For a few rows (a verify row's k + 1) MKL's sgemm streams the [vocab, hidden]
            # weight 2-3x faster as W x^T than as x W^T (issue #26); their transpose is small.
            return torch.mm(self.weight, x.t()).t().contiguous()
        # A batch: x W^T, row-major straight from the GEMM; W x^T's transposed copy of
        # every logit cost more than the product on `offline-cpu` (docs/benchmarks.md, #43).
        return kernels.linear(x, self.weight)
