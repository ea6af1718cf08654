"""CUDA paths: Triton kernels, CUDA graphs, pinned swap space, memory profiling, NCCL.

All `gpu`-marked: the lead's conftest skips them where torch sees no CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from workers_testlib import NUM_GREEDY_TOKENS, LocalExecutor, PlanBuilder, ProcessGroupExecutor

from scheduler.sampling_params import SamplingParams
from workers.cache_engine import CacheEngine
from workers.config import WorkerConfig
from workers.worker import Worker

pytestmark = pytest.mark.gpu


def _greedy(executor, prompts) -> PlanBuilder:
    builder = PlanBuilder(block_size=16, num_gpu_blocks=64, token_budget=24)
    for p in prompts:
        builder.add(p, SamplingParams(temperature=0), max_tokens=NUM_GREEDY_TOKENS)
    builder.run(executor)
    return builder


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_cuda_greedy_matches_transformers(tiny_dir, oracle, enforce_eager: bool) -> None:
    prompts, reference = oracle("tiny")
    ex = LocalExecutor(model=tiny_dir, device="cuda", enforce_eager=enforce_eager,
                       num_gpu_blocks=64, max_model_len=512, max_num_seqs=8)
    try:
        runner = ex.worker.model_runner.graph_runner
        if enforce_eager:
            assert runner is None
        else:
            assert sorted(runner.graphs) == [1, 2, 4, 8]
        builder = _greedy(ex, prompts)
        for sid, (tokens, logits) in enumerate(reference):
            assert builder.seqs[sid].outputs == tokens
            # Triton fp32 attention vs CPU eager: a looser bound than the CPU parity test.
            np.testing.assert_allclose(np.stack(builder.seqs[sid].logits), np.stack(logits),
                                       atol=2e-3, rtol=0)
    finally:
        ex.close()


def test_cuda_graph_replay_equals_eager_for_padded_batches(tiny_dir) -> None:
    """Decode batches of 1..8 sequences (3, 5, 6, 7 replay a padded graph) give eager's logits."""
    prompts = [list(range(100 + 7 * i, 120 + 9 * i)) for i in range(8)]
    results = []
    for eager in (True, False):
        ex = LocalExecutor(model=tiny_dir, device="cuda", enforce_eager=eager, num_gpu_blocks=96,
                           max_model_len=512, max_num_seqs=8)
        try:
            builder = PlanBuilder(block_size=16, num_gpu_blocks=96, token_budget=24)
            for i, p in enumerate(prompts):
                builder.add(p, SamplingParams(temperature=0), max_tokens=4 + 3 * i)
            results.append((builder.run(ex), [np.stack(s.logits) for s in builder.seqs.values()]))
        finally:
            ex.close()
    (eager_out, eager_logits), (graph_out, graph_logits) = results
    assert graph_out == eager_out
    for a, b in zip(eager_logits, graph_logits):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_cuda_swap_round_trip_uses_pinned_memory_and_never_syncs() -> None:
    dev = torch.device("cuda")
    eng = CacheEngine(3, 2, 8, 16, num_gpu_blocks=12, num_cpu_blocks=5, dtype=torch.bfloat16,
                      device=dev)
    assert eng.cpu_cache.is_pinned()
    eng.gpu_cache.copy_(torch.randn(eng.gpu_cache.shape, device=dev))
    original = eng.gpu_cache.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # swaps and copies never wait on the host
    try:
        eng.swap_out(np.array([[2, 4], [7, 0]]))
        eng.wait_transfers()  # the swap-out ran on the copy stream
        eng.gpu_cache[:, :, 2].zero_()
        eng.gpu_cache[:, :, 7].zero_()
        eng.swap_in(np.array([[4, 9], [0, 1]]))
        eng.copy(np.array([[9, 11]]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    bits = lambda t: t.view(torch.int16)  # noqa: E731
    assert torch.equal(bits(eng.gpu_cache[:, :, 9]), bits(original[:, :, 2]))
    assert torch.equal(bits(eng.gpu_cache[:, :, 1]), bits(original[:, :, 7]))
    assert torch.equal(bits(eng.gpu_cache[:, :, 11]), bits(original[:, :, 2]))


def test_profiled_block_count_respects_memory_utilization(tiny_dir) -> None:
    """(A tenth of the device: the GPU report's six test workers share one GPU.)"""
    w = Worker(WorkerConfig(model=tiny_dir, device="cuda", max_model_len=512, max_num_seqs=16,
                            max_num_batched_tokens=1024, gpu_memory_utilization=0.1,
                            swap_space=0.25))
    try:
        w.init_distributed()
        w.load_model()
        num_gpu, num_cpu, _ = w.determine_num_blocks()
        _, total = torch.cuda.mem_get_info()
        assert num_cpu == (1 << 28) // w.kv_block_bytes()
        assert 32 <= num_gpu and num_gpu * w.kv_block_bytes() <= 0.1 * total
        w.init_cache(num_gpu, num_cpu)
        assert w.cache_engine.cpu_cache.is_pinned()
    finally:
        w.shutdown()


def test_bfloat16_cuda_generates(second_dir) -> None:
    ex = LocalExecutor(model=second_dir, device="cuda", dtype="bfloat16", num_gpu_blocks=32,
                       max_model_len=512, max_num_seqs=4)
    try:
        builder = _greedy(ex, [list(range(3, 40)), list(range(50, 55))])
        assert all(len(s.outputs) == NUM_GREEDY_TOKENS for s in builder.seqs.values())
    finally:
        ex.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs 2 GPUs")
def test_nccl_tp2_matches_transformers(second_dir, oracle) -> None:
    prompts, reference = oracle("second")
    group = ProcessGroupExecutor(world_size=2)
    try:
        group.init(model=second_dir, device="cuda", num_gpu_blocks=64, max_model_len=512,
                   num_gpu_blocks_override=64, max_num_seqs=8)
        builder = _greedy(group, prompts)
        for sid, (tokens, _) in enumerate(reference):
            assert builder.seqs[sid].outputs == tokens
        group.shutdown_workers()
    finally:
        group.close()
