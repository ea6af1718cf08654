"""Greedy tokens and logits match Hugging Face transformers (fp32, CPU) for tp = 1 and tp = 2.

The batch mixes prompts of 5..40 tokens (one to three 16-token blocks), prefilled in chunks
under a 24-token budget while other sequences decode, then 32 greedy tokens each.
Logits tolerance: atol 1e-4 (observed differences are ~1e-5: fp32 summation order).
"""

from __future__ import annotations

import numpy as np
import pytest
from workers_testlib import NUM_GREEDY_TOKENS, LocalExecutor, PlanBuilder

from scheduler.sampling_params import SamplingParams

MODELS = ("tiny", "second", "single_kv")


class _Recorder:
    """Passes plans through and remembers whether a step mixed decodes with prefill chunks."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.mixed_steps = 0
        self.chunked_steps = 0

    def execute(self, plan):
        q, s = plan.query_lens, plan.do_sample
        self.mixed_steps += bool((q == 1).any() and (q > 1).any())
        self.chunked_steps += bool((~s).any())
        return self.inner.execute(plan)


def _check_parity(executor, prompts, reference) -> None:
    builder = PlanBuilder(block_size=16, num_gpu_blocks=64, token_budget=24)
    ids = [builder.add(p, SamplingParams(temperature=0), max_tokens=NUM_GREEDY_TOKENS)
           for p in prompts]
    rec = _Recorder(executor)
    outputs = builder.run(rec)
    assert rec.mixed_steps > 0 and rec.chunked_steps > 0
    for sid, (ref_tokens, ref_logits) in zip(ids, reference):
        assert outputs[sid] == ref_tokens
        got = np.stack(builder.seqs[sid].logits)
        # The first row is the prefill's logits at the last prompt token.
        np.testing.assert_allclose(got[0], ref_logits[0], atol=1e-4, rtol=0)
        np.testing.assert_allclose(got, np.stack(ref_logits), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_tp1_matches_transformers(name, model_dirs, oracle) -> None:
    prompts, reference = oracle(name)
    executor = LocalExecutor(model=model_dirs[name], num_gpu_blocks=64, max_model_len=512)
    try:
        _check_parity(executor, prompts, reference)
    finally:
        executor.close()


@pytest.mark.parametrize("name", MODELS)
def test_tp2_matches_transformers(name, model_dirs, oracle, tp2_group) -> None:
    prompts, reference = oracle(name)
    counts = tp2_group.init(model=model_dirs[name], num_gpu_blocks=64, max_model_len=512,
                            num_gpu_blocks_override=64, swap_space=0.001)
    try:
        assert counts[0] == counts[1] and counts[0][0] == 64
        _check_parity(tp2_group, prompts, reference)
    finally:
        tp2_group.shutdown_workers()


class _TokensOnly:
    """Runs plans on the ranks without keeping logits: a step of plain greedy rows then takes
    each rank's argmax over its vocabulary shard (workers/sampler.py `greedy_over_shards`)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def execute(self, plan):
        return self.inner.execute(plan, keep_logits=False)


@pytest.mark.parametrize("name", MODELS)
def test_tp2_greedy_over_vocabulary_shards_matches_transformers(name, model_dirs, oracle,
                                                               tp2_group) -> None:
    prompts, reference = oracle(name)
    tp2_group.init(model=model_dirs[name], num_gpu_blocks=64, max_model_len=512)
    try:
        builder = PlanBuilder(block_size=16, num_gpu_blocks=64, token_budget=24)
        ids = [builder.add(p, SamplingParams(temperature=0), max_tokens=NUM_GREEDY_TOKENS)
               for p in prompts]
        outputs = builder.run(_TokensOnly(tp2_group))
    finally:
        tp2_group.shutdown_workers()
    assert [outputs[sid] for sid in ids] == [tokens for tokens, _ in reference]
    assert all(not builder.seqs[sid].logits for sid in ids)  # (no logits came back)


def test_tp2_swap_fork_and_seeded_sampling_match_tp1(second_dir, tp2_group) -> None:
    """Swap out/in and a copy-on-write fork on two ranks give tp = 1's tokens; seeded
    sampling on rank 0 gives the same tokens as a single worker."""
    prompts = [list(range(40, 75)), list(range(300, 309)), list(range(600, 621))]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0),
              SamplingParams(temperature=1.5, seed=31)]

    def scenario(executor) -> dict[int, list[int]]:
        builder = PlanBuilder(block_size=16, num_gpu_blocks=64, num_cpu_blocks=8, token_budget=24)
        for p, sp in zip(prompts, params):
            builder.add(p, sp, max_tokens=12)
        hooks = {5: lambda b: b.swap_out(0), 7: lambda b: b.swap_in(0),
                 6: lambda b: b.fork(1, seq_index=1)}
        return builder.run(executor, hooks=hooks)

    local = LocalExecutor(model=second_dir, num_gpu_blocks=64, num_cpu_blocks=8, max_model_len=512)
    try:
        expected = scenario(local)
    finally:
        local.close()
    tp2_group.init(model=second_dir, num_gpu_blocks=64, num_cpu_blocks=8, max_model_len=512)
    try:
        got = scenario(tp2_group)
        states = tp2_group.state()
    finally:
        tp2_group.shutdown_workers()
    assert got == expected and len(got) == 4 and got[3] == got[1]
    # Every finished sequence was dropped on both ranks.
    assert states[0]["seqs"] == [] and states[1]["seqs"] == []
