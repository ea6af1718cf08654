"""Greedy sampling over vocabulary shards (workers/sampler.py `greedy_over_shards`), in spawned
ranks of a real CPU `TensorParallelGroup`: rank 0's tokens equal `row_argmax` (and
`torch.argmax`) of the whole rows, ties included, for world 1, 2 and 3, a vocabulary the ranks
do not split evenly (the LM head's padding cut), fp32 and bf16; the other ranks get None.

Every rank builds the same full logits from a seed and keeps its shard, as
`ParallelLMHead.greedy_tokens` does. Ties are planted across shard boundaries (the lowest id
must win) and inside a shard; one row is all -inf but one column, one all negative.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from workers_testlib import run_ranks

from workers.distributed import TensorParallelGroup
from workers.sampler import greedy_over_shards, row_argmax

VOCAB = 1001  # split 334 + 334 + 333 over three ranks, 501 + 500 over two
ROWS = 9


def _logits(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS, VOCAB, generator=g)
    x[0, [10, 600, 900]] = 9.0  # a tie across every shard boundary: id 10 wins
    x[1, [700, 400]] = 9.0  # rank 0 (or 1) holds the lower id: 400
    x[2, [350, 340]] = 9.0  # a tie inside one shard (tp 3: rank 1's), first id wins: 340
    x[3] = float("-inf")
    x[3, VOCAB - 1] = 0.0  # the last column, on the last rank
    x[4] = -x[4].abs() - 1.0  # all negative: zero padding must never win
    x[5, VOCAB - 1] = 9.0
    return x.to(dtype)


def _shard_of(tp: TensorParallelGroup) -> tuple[int, int]:
    per = -(-VOCAB // tp.world_size)  # VocabParallelEmbedding's split
    start = per * tp.rank
    return start, min(start + per, VOCAB)


def case_greedy(tp: TensorParallelGroup) -> dict[str, Any]:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        start, end = _shard_of(tp)
        tokens = greedy_over_shards(_logits(dtype)[:, start:end], start, tp)
        out[str(dtype)] = None if tokens is None else tokens.tolist()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_rank0_gets_the_argmax_of_the_whole_rows(world: int) -> None:
    out = run_ranks(world, case_greedy)
    for dtype in (torch.float32, torch.bfloat16):
        full = _logits(dtype)
        want = row_argmax(full).tolist()
        assert want == full.argmax(dim=1).tolist()
        assert want[:6] == [10, 400, 340, VOCAB - 1, want[4], VOCAB - 1]
        assert out[0][str(dtype)] == want
        assert all(out[r][str(dtype)] is None for r in range(1, world))


def test_a_single_rank_is_row_argmax() -> None:
    full = _logits(torch.float32)
    tokens = greedy_over_shards(full, 0, TensorParallelGroup.single())
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, row_argmax(full))
