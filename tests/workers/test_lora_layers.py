"""The LoRA wrappers of the parallel layers (workers/lora/): a packed layer's slices land in
their own rows and columns, rows without an adapter stay the base layer's, and the slot loads
and plans a worker cannot honour are ValueErrors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scheduler.plan import LoRALoad, LoRAWeights, NewSeq, StepPlan
from scheduler.sampling_params import SamplingParams
from workers.distributed import TensorParallelGroup
from workers.layers import QKVParallelLinear, RowParallelLinear
from workers.lora import (
    ColumnParallelLinearWithLoRA,
    LoRABatch,
    RowParallelLinearWithLoRA,
    check_lora_plan,
)

HIDDEN, HEAD, HEADS, KV_HEADS = 32, 8, 4, 2


def _batch(slots: list[int]) -> LoRABatch:
    buffer = torch.full((16,), -1, dtype=torch.int64)
    buffer[:len(slots)] = torch.tensor(slots)
    return LoRABatch(buffer, active=True, backend="torch")


def test_a_packed_qkv_adapter_on_k_alone_changes_only_k_rows_of_its_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    base = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, TensorParallelGroup.single(),
                             torch.float32)
    base.weight.data.copy_(torch.randn(base.weight.shape, generator=g))
    batch = _batch([0, -1, 1])
    layer = ColumnParallelLinearWithLoRA(base, [("q_proj", "q"), ("k_proj", "k"),
                                                ("v_proj", "v")], 2, 4, batch)
    a, b = torch.randn(3, HIDDEN, generator=g), torch.randn(KV_HEADS * HEAD, 3, generator=g)
    layer.set_slot(0, 5, {"layers.5.k_proj": (a.numpy(), b.numpy())})
    q2, v2 = torch.randn(4, HIDDEN, generator=g), torch.randn(KV_HEADS * HEAD, 4, generator=g)
    layer.set_slot(1, 5, {"layers.5.q_proj": (q2.numpy(), torch.randn(HEADS * HEAD, 4).numpy()),
                          "layers.5.v_proj": (q2.numpy(), v2.numpy())})
    x = torch.randn(3, HIDDEN, generator=g)
    out, plain = layer(x), base(x)
    q, kv = HEADS * HEAD, KV_HEADS * HEAD
    expected = plain.clone()
    expected[0, q:q + kv] += b @ (a @ x[0])  # slot 0: k only
    torch.testing.assert_close(out[0], expected[0])
    assert torch.equal(out[1], plain[1])  # a base row
    torch.testing.assert_close(out[2, q + kv:], plain[2, q + kv:] + v2 @ (q2 @ x[2]))
    assert torch.equal(out[2, q:q + kv], plain[2, q:q + kv])  # slot 1 has no k
    layer.set_slot(0, 5, {})  # reloaded with an adapter that skips this layer: zeros
    assert torch.equal(layer(x)[0], plain[0])


def test_a_row_parallel_wrapper_adds_before_the_reduce_and_skips_inactive_batches() -> None:
    g = torch.Generator().manual_seed(1)
    base = RowParallelLinear(HIDDEN, 16, TensorParallelGroup.single(), torch.float32)
    base.weight.data.copy_(torch.randn(base.weight.shape, generator=g))
    batch = _batch([0, 0])
    layer = RowParallelLinearWithLoRA(base, [("o_proj", None)], 1, 8, batch)
    a, b = torch.randn(8, HIDDEN, generator=g), torch.randn(16, 8, generator=g)
    layer.set_slot(0, 0, {"layers.0.o_proj": (a.numpy(), b.numpy())})
    x = torch.randn(2, HIDDEN, generator=g)
    torch.testing.assert_close(layer(x), base(x) + x @ a.T @ b.T)
    batch.active = False
    assert torch.equal(layer(x), base(x))


def _plan(lora_slot: int, loads: list[LoRALoad]) -> StepPlan:
    empty = np.zeros(0, dtype=np.int64)
    return StepPlan(step_id=3, seq_ids=empty, query_lens=empty.astype(np.int32),
                    start_pos=empty.astype(np.int32), input_ids=empty,
                    do_sample=empty.astype(bool),
                    new_seqs=[NewSeq(7, "r", 0, 1, [], [0], SamplingParams(), lora_slot=lora_slot)],
                    lora_loads=loads)


def test_plans_naming_slots_the_worker_lacks_are_refused() -> None:
    check_lora_plan(_plan(1, [LoRALoad(1, 4)]), max_loras=2)
    with pytest.raises(ValueError, match="seq 7 runs in LoRA slot 2, but this worker has 2"):
        check_lora_plan(_plan(2, []), max_loras=2)
    with pytest.raises(ValueError, match="it loads LoRA adapters, but this worker has 0"):
        check_lora_plan(_plan(-1, [LoRALoad(0, 4)]), max_loras=0)


def test_slot_loads_check_slot_weights_and_rank(tiny_model_path: str) -> None:
    from workers.config import WorkerConfig
    from workers.worker import Worker

    worker = Worker(WorkerConfig(model=tiny_model_path, max_loras=2, max_lora_rank=4))
    worker.load_model()
    lora = worker.lora
    weights = LoRAWeights(8, {})
    with pytest.raises(ValueError, match="slot 2; this worker has 2"):
        lora.load([LoRALoad(2, 1, weights)])
    with pytest.raises(ValueError, match="carries no weights"):
        lora.load([LoRALoad(0, 1)])
    with pytest.raises(ValueError, match="rank 8; max_lora_rank is 4"):
        lora.load([LoRALoad(0, 1, weights)])
    # every dense projection of every layer is wrapped
    assert len(lora.layers) == 4 * 4
