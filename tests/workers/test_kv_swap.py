"""KV swap out/in and copy-on-write: exact bytes, and unchanged generations around them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from workers_testlib import LocalExecutor, PlanBuilder

from scheduler.sampling_params import SamplingParams
from workers.cache_engine import CacheEngine

CPU = torch.device("cpu")


def _engine(dtype: torch.dtype = torch.float32) -> CacheEngine:
    eng = CacheEngine(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, num_gpu_blocks=10,
                      num_cpu_blocks=6, dtype=dtype, device=CPU)
    g = torch.Generator().manual_seed(0)
    eng.gpu_cache.copy_(torch.randn(eng.gpu_cache.shape, generator=g))
    return eng


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_round_trip_and_copy_keep_bytes(dtype: torch.dtype) -> None:
    eng = _engine(dtype)
    original = eng.gpu_cache.clone()
    eng.swap_out(np.array([[3, 0], [5, 4], [9, 1]]))
    for gpu, cpu in ((3, 0), (5, 4), (9, 1)):
        assert torch.equal(_bits(eng.cpu_cache[cpu]), _bits(original[:, :, gpu]))
    eng.gpu_cache[:, :, [3, 5, 9]] = 0  # the freed blocks get reused by someone else
    eng.swap_in(np.array([[0, 7], [4, 2], [1, 3]]))
    for gpu_new, gpu_old in ((7, 3), (2, 5), (3, 9)):
        assert torch.equal(_bits(eng.gpu_cache[:, :, gpu_new]), _bits(original[:, :, gpu_old]))
    before = eng.gpu_cache.clone()
    eng.copy(np.array([[7, 8], [0, 6]]))
    assert torch.equal(_bits(eng.gpu_cache[:, :, 8]), _bits(before[:, :, 7]))
    assert torch.equal(_bits(eng.gpu_cache[:, :, 6]), _bits(before[:, :, 0]))
    untouched = [b for b in range(10) if b not in (6, 8)]
    assert torch.equal(_bits(eng.gpu_cache[:, :, untouched]), _bits(before[:, :, untouched]))


def test_copies_read_all_sources_before_writing() -> None:
    eng = _engine()
    before = eng.gpu_cache.clone()
    eng.copy(np.array([[1, 2], [2, 3]]))  # block 2 is both a destination and a source
    assert torch.equal(eng.gpu_cache[:, :, 2], before[:, :, 1])
    assert torch.equal(eng.gpu_cache[:, :, 3], before[:, :, 2])


def test_out_of_range_block_ids_are_value_errors() -> None:
    eng = _engine()
    with pytest.raises(ValueError, match="swap-out CPU"):
        eng.swap_out(np.array([[0, 6]]))
    with pytest.raises(ValueError, match="copy destination"):
        eng.copy(np.array([[0, 10]]))


@pytest.fixture(scope="module")
def tiny_executor(tiny_dir: str):
    ex = LocalExecutor(model=tiny_dir, num_gpu_blocks=48, num_cpu_blocks=16, max_model_len=512)
    yield ex
    ex.close()


PROMPTS = ([11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333, 444, 555, 666, 777, 888, 999, 1234],
           list(range(2000, 2030)), [5, 6, 7])


def _generate(executor, hooks=None, num_gpu_blocks: int = 48) -> tuple[PlanBuilder, dict]:
    builder = PlanBuilder(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=16, token_budget=24)
    for p in PROMPTS:
        builder.add(p, SamplingParams(temperature=0), max_tokens=20)
    return builder, builder.run(executor, hooks=hooks)


def test_generation_unchanged_by_swap_out_and_in(tiny_executor) -> None:
    _, baseline = _generate(tiny_executor)
    seen: dict[str, object] = {}

    def out(b: PlanBuilder) -> None:
        s = b.seqs[0]
        seen["old_blocks"] = list(s.blocks)
        seen["kv"] = tiny_executor.worker.cache_engine.gpu_cache[:, :, s.blocks].clone()
        seen["num_computed"] = s.num_computed
        b.swap_out(0)

    def back(b: PlanBuilder) -> None:
        b.swap_in(0)

    def check(b: PlanBuilder) -> None:
        blocks = b.seqs[0].blocks[:len(seen["old_blocks"])]
        assert blocks != seen["old_blocks"]
        kv = tiny_executor.worker.cache_engine.gpu_cache[:, :, blocks]
        full = seen["num_computed"] // b.block_size
        # The swapped-in blocks hold the same bytes as before the swap (full blocks untouched
        # since; the partial last block only gained the new tokens' slots).
        assert torch.equal(kv[:, :, :full].view(torch.int32), seen["kv"][:, :, :full].view(torch.int32))

    _, swapped = _generate(tiny_executor, hooks={4: out, 8: back, 9: check})
    assert swapped == baseline
    assert 0 not in tiny_executor.worker.model_runner.seqs  # dropped when it finished


def test_forked_sequence_copies_partial_block_and_continues_identically(tiny_executor) -> None:
    builder = PlanBuilder(num_gpu_blocks=48, token_budget=64)
    parent = builder.add(PROMPTS[0], SamplingParams(temperature=0), max_tokens=12)
    forks: list[int] = []

    def fork(b: PlanBuilder) -> None:
        # 19 prompt tokens + 2 computed outputs: block 0 full (shared), block 1 partial (copied).
        assert b.seqs[parent].num_computed == 21
        child = b.fork(parent, seq_index=1)
        forks.append(child)
        p_blocks, c_blocks = b.seqs[parent].blocks, b.seqs[child].blocks
        assert c_blocks[0] == p_blocks[0] and c_blocks[1] != p_blocks[1]
        assert b.pending_copies == [(p_blocks[1], c_blocks[1])]

    outputs = builder.run(tiny_executor, hooks={3: fork})
    assert len(outputs[forks[0]]) == 12
    assert outputs[forks[0]] == outputs[parent]
