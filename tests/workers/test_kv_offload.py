"""The CPU offload tier on the workers: a block loaded back equals, bit for bit, the block that
was evicted (every layer, K and V, every rank), with the plan's order inside one step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from workers_testlib import LocalExecutor

from scheduler.plan import NewSeq, StepPlan
from scheduler.sampling_params import SamplingParams
from workers.cache_engine import CacheEngine

BS = 16


def _prefill(step_id: int, seq_id: int, tokens: list[int], table: list[int]) -> StepPlan:
    n = len(tokens)
    return StepPlan(step_id=step_id, seq_ids=np.array([seq_id], dtype=np.int64),
                    query_lens=np.array([n], dtype=np.int32),
                    start_pos=np.zeros(1, dtype=np.int32),
                    input_ids=np.array(tokens, dtype=np.int64), do_sample=np.ones(1, bool),
                    new_seqs=[NewSeq(seq_id, f"r{seq_id}", 0, n, [], table,
                                     SamplingParams(temperature=0))])


def _copies(step_id: int, dropped: list[int], offload: list, load: list) -> StepPlan:
    empty = np.zeros(0, dtype=np.int64)
    return StepPlan(step_id=step_id, seq_ids=empty, query_lens=empty.astype(np.int32),
                    start_pos=empty.astype(np.int32), input_ids=empty,
                    do_sample=np.zeros(0, bool), dropped_seq_ids=dropped,
                    offload=np.array(offload, dtype=np.int64).reshape(-1, 2),
                    load=np.array(load, dtype=np.int64).reshape(-1, 2))


def _round_trip(executor) -> None:
    """Blocks 0-2 written by a prefill, offloaded to tier blocks 4, 0, 2; the GPU blocks
    overwritten by another sequence; loaded back into blocks 7, 8, 9. In one step, an offload
    and a load of the same tier block: the load reads what the offload wrote."""
    executor.execute(_prefill(1, 1, list(range(300, 300 + 3 * BS)), [0, 1, 2]))
    before = executor.kv([0, 1, 2], [])
    executor.execute(_copies(2, [1], [[0, 4], [1, 0], [2, 2]], []))
    executor.execute(_prefill(3, 2, list(range(900, 900 + 3 * BS)), [0, 1, 2]))
    overwritten = executor.kv([0, 1, 2], [4, 0, 2])
    executor.execute(_copies(4, [2], [], [[4, 7], [0, 8], [2, 9]]))
    after = executor.kv([7, 8, 9], [])
    executor.execute(_copies(5, [], [[9, 1]], [[1, 10]]))  # offload then load, same step
    same_step = executor.kv([10], [])
    for rank, ((gpu, _), (other, tier), (loaded, _), (chained, _)) in enumerate(
            zip(before, overwritten, after, same_step)):
        assert gpu.shape[0] == 2 and gpu.shape[2] == 3  # K and V, every layer, three blocks
        assert not np.array_equal(gpu, other), f"rank {rank}: the second prefill wrote nothing"
        for i in range(3):
            assert np.array_equal(tier[i], gpu[:, :, i]), f"rank {rank}: offload of block {i}"
        assert loaded.tobytes() == gpu.tobytes(), f"rank {rank}: loaded blocks differ"
        assert chained.tobytes() == gpu[:, :, 2:3].tobytes(), f"rank {rank}: same-step order"


def test_offloaded_blocks_load_back_bitwise_tp1(tiny_dir: str) -> None:
    ex = LocalExecutor(model=tiny_dir, num_gpu_blocks=16, num_cpu_blocks=2, num_offload_blocks=6,
                       max_model_len=256)
    try:
        _round_trip(ex)
    finally:
        ex.close()


@pytest.mark.slow
def test_offloaded_blocks_load_back_bitwise_on_every_rank_tp2(second_dir: str, tp2_group) -> None:
    tp2_group.init(model=second_dir, num_gpu_blocks=16, num_cpu_blocks=2, num_offload_blocks=6,
                   max_model_len=256)
    try:
        _round_trip(tp2_group)
        shards = tp2_group.kv([7], [])
        assert not np.array_equal(shards[0][0], shards[1][0]), "the ranks hold different heads"
    finally:
        tp2_group.shutdown_workers()


def test_tier_copies_keep_bf16_bytes_and_check_ids() -> None:
    eng = CacheEngine(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, num_gpu_blocks=6,
                      num_cpu_blocks=0, dtype=torch.bfloat16, device=torch.device("cpu"),
                      num_offload_blocks=3)
    eng.gpu_cache.copy_(torch.randn(eng.gpu_cache.shape, generator=torch.Generator().manual_seed(0)))
    original = eng.gpu_cache[:, :, 5].clone()
    eng.offload(np.array([[5, 2]]))
    eng.gpu_cache[:, :, 5] = 0
    eng.load(np.array([[2, 0]]))
    assert torch.equal(eng.gpu_cache[:, :, 0].view(torch.int16), original.view(torch.int16))
    with pytest.raises(ValueError, match="offload tier block id out of range"):
        eng.offload(np.array([[0, 3]]))
    with pytest.raises(ValueError, match="load GPU block id out of range"):
        eng.load(np.array([[0, 6]]))
