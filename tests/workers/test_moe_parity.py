"""Qwen3-MoE greedy tokens and logits equal transformers' `Qwen3MoeForCausalLM` (fp32, CPU).

Two configs: every layer sparse with norm_topk_prob true, and dense layers mixed with sparse
ones (decoder_sparse_step 2) with it false; at tp 1, tp 2 splitting every expert (TP) and
tp 2 giving each rank whole experts (EP); under preemption by swap and by recompute; with
routers that send every token to the same experts and ones that spread tokens over all.
Batches mix chunked prefills (24-token budget) with decodes, as test_tp_parity.py does.
"""

from __future__ import annotations

import numpy as np
import pytest
from moe_testlib import (
    MOE_ALL_SPARSE,
    MOE_MIXED,
    hf_experts_used,
    route_every_token_to_first_experts,
)
from workers_testlib import LocalExecutor, PlanBuilder, hf_greedy, parity_prompts

from workers.tiny_model import write_random_qwen3

NUM_TOKENS = 16
CONFIGS = {"all_sparse": (MOE_ALL_SPARSE, 21), "mixed": (MOE_MIXED, 22),
           "one_route": (MOE_ALL_SPARSE, 23)}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """moe_model(name) -> (checkpoint dir, prompts, transformers' greedy reference), cached."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            cfg, seed = CONFIGS[name]
            path = str(write_random_qwen3(tmp_path_factory.mktemp("moe") / name, cfg, seed))
            if name == "one_route":
                route_every_token_to_first_experts(path, cfg["num_experts_per_tok"])
            prompts = parity_prompts(cfg["vocab_size"])
            cache[name] = (path, prompts, hf_greedy(path, prompts, NUM_TOKENS))
        return cache[name]

    return get


def _run(executor, prompts, hooks=None) -> PlanBuilder:
    builder = PlanBuilder(block_size=16, num_gpu_blocks=64, num_cpu_blocks=16, token_budget=24)
    for p in prompts:
        builder.add(p, max_tokens=NUM_TOKENS)
    builder.run(executor, hooks=hooks)
    return builder


def _assert_matches(builder: PlanBuilder, reference) -> None:
    for sid, (ref_tokens, ref_logits) in enumerate(reference):
        assert builder.seqs[sid].outputs == ref_tokens, f"sequence {sid}"
        np.testing.assert_allclose(np.stack(builder.seqs[sid].logits), np.stack(ref_logits),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["all_sparse", "mixed"])
def test_tp1_matches_transformers(name, moe_model) -> None:
    path, prompts, reference = moe_model(name)
    executor = LocalExecutor(model=path, num_gpu_blocks=64, max_model_len=512)
    try:
        _assert_matches(_run(executor, prompts), reference)
    finally:
        executor.close()


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
@pytest.mark.parametrize("name", ["all_sparse", "mixed", "one_route"])
def test_tp2_matches_transformers(name, expert_parallel, moe_model, tp2_group) -> None:
    path, prompts, reference = moe_model(name)
    tp2_group.init(model=path, num_gpu_blocks=64, num_cpu_blocks=16, max_model_len=512,
                   num_gpu_blocks_override=64, swap_space=0.001,
                   enable_expert_parallel=expert_parallel)
    try:
        _assert_matches(_run(tp2_group, prompts), reference)
    finally:
        tp2_group.shutdown_workers()


def _preempt(builder: PlanBuilder, sid: int) -> None:
    """Preemption by recompute: drop the sequence and prefill its prompt + outputs again."""
    s = builder.seqs[sid]
    builder._release(s.blocks)
    s.blocks, s.sent, s.num_computed, s.prompt_len = [], False, 0, len(s.tokens)
    builder.pending_drops.append(sid)


# Step 5: swap sequence 0 out (back in at step 8); step 6: recompute sequence 2.
PREEMPTIONS = {5: lambda b: b.swap_out(0), 8: lambda b: b.swap_in(0),
               6: lambda b: _preempt(b, 2)}


def test_preemption_by_swap_and_recompute_keeps_tokens(moe_model) -> None:
    path, prompts, reference = moe_model("all_sparse")
    executor = LocalExecutor(model=path, num_gpu_blocks=64, num_cpu_blocks=16, max_model_len=512)
    try:
        builder = _run(executor, prompts, hooks=PREEMPTIONS)
    finally:
        executor.close()
    for sid, (ref_tokens, _) in enumerate(reference):
        assert builder.seqs[sid].outputs == ref_tokens, f"sequence {sid}"
    # The recomputed sequence really was prefilled again past its first outputs.
    assert builder.seqs[2].prompt_len > len(prompts[2])


@pytest.mark.slow
def test_tp2_expert_parallel_under_preemption(moe_model, tp2_group) -> None:
    path, prompts, reference = moe_model("mixed")
    tp2_group.init(model=path, num_gpu_blocks=64, num_cpu_blocks=16, max_model_len=512,
                   enable_expert_parallel=True)
    try:
        builder = _run(tp2_group, prompts, hooks=PREEMPTIONS)
    finally:
        tp2_group.shutdown_workers()
    assert [builder.seqs[s].outputs for s in range(len(prompts))] == [r[0] for r in reference]


def test_routing_fixtures_route_as_claimed(moe_model) -> None:
    """The crafted router sends every token to experts {0, 1} (under EP all on rank 0, so
    rank 1 computes nothing); the random one spreads tokens over all 8 experts."""
    path, prompts, _ = moe_model("one_route")
    assert hf_experts_used(path, prompts) == [{0, 1}, {0, 1}]
    path, prompts, _ = moe_model("all_sparse")
    assert hf_experts_used(path, prompts) == [set(range(8)), set(range(8))]


def test_one_route_tp1_matches_transformers(moe_model) -> None:
    path, prompts, reference = moe_model("one_route")
    executor = LocalExecutor(model=path, num_gpu_blocks=64, max_model_len=512)
    try:
        _assert_matches(_run(executor, prompts), reference)
    finally:
        executor.close()


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("name", ["all_sparse", "mixed"])
def test_cuda_triton_moe_matches_transformers(name, enforce_eager, moe_model) -> None:
    """fp32 on CUDA: the Triton MoE kernel, eager and inside the decode CUDA graphs."""
    path, prompts, reference = moe_model(name)
    executor = LocalExecutor(model=path, device="cuda", dtype="float32", num_gpu_blocks=64,
                             max_model_len=512, max_num_seqs=8, enforce_eager=enforce_eager)
    try:
        runner = executor.worker.model_runner.graph_runner
        assert (runner is None) == enforce_eager
        builder = _run(executor, prompts)
    finally:
        executor.close()
    for sid, (ref_tokens, ref_logits) in enumerate(reference):
        assert builder.seqs[sid].outputs == ref_tokens, f"sequence {sid}"
        np.testing.assert_allclose(np.stack(builder.seqs[sid].logits), np.stack(ref_logits),
                                   atol=2e-3, rtol=0)
