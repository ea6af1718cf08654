"""Each parallel layer's weight_loader picks exactly its rank's shard of the full tensor.

Ranks are simulated with `TensorParallelGroup(rank, world_size)` (no collectives run here);
the forward passes across real ranks are covered by test_tp_parity.py.
"""

from __future__ import annotations

import pytest
import torch

from workers.distributed import TensorParallelGroup
from workers.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightSource,
)

F32 = torch.float32


def _src(name: str, t: torch.Tensor) -> WeightSource:
    return WeightSource(name, tensor=t)


def _arange(*shape: int) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=F32).reshape(shape)


@pytest.mark.parametrize("rank", [0, 1])
def test_column_and_row_parallel_shards(rank: int) -> None:
    tp = TensorParallelGroup(rank, 2)
    full = _arange(6, 4)
    col = ColumnParallelLinear(4, 6, tp, F32)
    col.weight.weight_loader(col.weight, _src("w", full))
    assert torch.equal(col.weight, full[3 * rank:3 * rank + 3])
    row = RowParallelLinear(4, 6, tp, F32)
    row.weight.weight_loader(row.weight, _src("w", full))
    assert torch.equal(row.weight, full[:, 2 * rank:2 * rank + 2])


def test_merged_gate_up_packs_each_rank_half_of_both() -> None:
    gate, up = _arange(8, 3), _arange(8, 3) + 100
    layer = MergedColumnParallelLinear(3, [8, 8], TensorParallelGroup(1, 2), F32)
    layer.weight.weight_loader(layer.weight, _src("gate", gate), 0)
    layer.weight.weight_loader(layer.weight, _src("up", up), 1)
    assert torch.equal(layer.weight, torch.cat([gate[4:], up[4:]]))


@pytest.mark.parametrize(("world", "rank", "kv_head"), [(2, 0, 0), (2, 1, 1), (4, 1, 0),
                                                        (4, 2, 1), (4, 3, 1)])
def test_qkv_shards_query_heads_and_splits_or_replicates_kv(world, rank, kv_head) -> None:
    d, nq, nkv, hidden = 2, 4, 2, 3
    q, k, v = _arange(nq * d, hidden), _arange(nkv * d, hidden) + 1000, _arange(nkv * d, hidden) + 2000
    layer = QKVParallelLinear(hidden, d, nq, nkv, TensorParallelGroup(rank, world), F32)
    for shard, t in (("q", q), ("k", k), ("v", v)):
        layer.weight.weight_loader(layer.weight, _src(shard, t), shard)
    heads = nq // world
    per_rank_kv = 1 if world >= nkv else nkv // world
    expected_q = q[rank * heads * d:(rank + 1) * heads * d]
    kv_rows = slice(kv_head * d, (kv_head + per_rank_kv) * d)
    assert layer.num_kv_heads == per_rank_kv
    assert torch.equal(layer.weight, torch.cat([expected_q, k[kv_rows], v[kv_rows]]))


def test_tp_not_dividing_heads_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="num_attention_heads"):
        QKVParallelLinear(8, 2, 4, 2, TensorParallelGroup(0, 3), F32)
    with pytest.raises(ValueError, match="not a multiple"):
        QKVParallelLinear(8, 2, 6, 4, TensorParallelGroup(0, 6), F32)


def test_vocab_parallel_pads_the_last_shard_with_zeros() -> None:
    full = _arange(5, 2) + 1
    first = VocabParallelEmbedding(5, 2, TensorParallelGroup(0, 2), F32)
    last = ParallelLMHead(5, 2, TensorParallelGroup(1, 2), F32)
    for layer in (first, last):
        layer.weight.weight_loader(layer.weight, _src("emb", full))
    assert torch.equal(first.weight, full[:3])
    assert torch.equal(last.weight, torch.cat([full[3:], torch.zeros(1, 2)]))
    assert (first.vocab_start_idx, first.vocab_end_idx) == (0, 3)
    assert (last.vocab_start_idx, last.vocab_end_idx) == (3, 5)


def test_shape_mismatch_names_the_tensor() -> None:
    layer = ColumnParallelLinear(4, 6, TensorParallelGroup.single(), F32)
    with pytest.raises(ValueError, match="q_proj"):
        layer.weight.weight_loader(layer.weight, _src("model.layers.0.q_proj.weight", _arange(6, 5)))


@pytest.mark.parametrize("rows", [1, 5, 8, 9, 64])
def test_cpu_lm_head_gives_row_major_logits_of_x_w_t(rows: int) -> None:
    """Few rows take W x^T, a batch x W^T (embed_head.CPU_WXT_MAX_ROWS): the same product,
    row-major [rows, vocab] either way."""
    gen = torch.Generator().manual_seed(rows)
    head = ParallelLMHead(1000, 16, TensorParallelGroup.single(), F32)
    head.weight.data.copy_(torch.randn(1000, 16, generator=gen))
    x = torch.randn(rows, 16, generator=gen)
    logits = head(x)
    assert logits.shape == (rows, 1000) and logits.is_contiguous()
    torch.testing.assert_close(logits, x.double().mm(head.weight.double().t()).float(),
                               atol=1e-5, rtol=1e-5)
