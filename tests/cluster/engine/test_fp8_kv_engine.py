"""FP8 KV cache through the engine (qwen3-tiny, CPU, torch kernels): prefix hits, the CPU
offload tier, preemption and speculative decoding (a draft model whose KV shares the FP8
cache, and n-gram proposals) give the tokens of a plain FP8 run. The bound against a
full-precision cache is tests/workers/test_fp8_kv_cache.py's."""

from __future__ import annotations

import random

import pytest

from cluster import LLM, SamplingParams

# 12 blocks of 16 tokens for four sequences of up to ~90 tokens: prefix blocks are evicted
# (and offloaded when the tier is on) and sequences preempted.
ENGINE = dict(model="qwen3-tiny", device="cpu", block_size=16, num_gpu_blocks_override=12,
              max_model_len=256, max_num_seqs=4, max_num_batched_tokens=48, swap_space=0.01,
              async_scheduling=False, kv_cache_dtype="fp8")
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts() -> list[dict]:
    rng = random.Random(3)
    shared = [rng.randrange(100, 150000) for _ in range(40)]
    return [{"prompt_token_ids": shared + [rng.randrange(100, 150000) for _ in range(k)]}
            for k in (2, 25, 9)] + [{"prompt_token_ids": [rng.randrange(100, 150000)
                                                          for _ in range(60)]}]


def _run(llm: LLM, rounds: int = 2) -> list[list[int]]:
    """Each prompt twice (the second round hits the prefix cache or the tier)."""
    out = []
    for _ in range(rounds):
        out += [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS, use_tqdm=False)]
    kv = llm.engine.scheduler.kv
    kv.check_invariants()
    return out


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    with LLM(**ENGINE, enable_prefix_caching=False) as llm:
        return _run(llm)


def test_prefix_hits_and_offload_tier_give_the_plain_tokens(plain) -> None:
    with LLM(**ENGINE, kv_offloading_size=0.002) as llm:
        assert _run(llm) == plain
        m = llm.engine.metrics()
        assert llm.engine.scheduler.kv.stats().prefix_hits > 0
    assert m["kv_offload_blocks_offloaded"] > 0


@pytest.mark.parametrize("spec", [
    {"model": "qwen3-tiny", "num_speculative_tokens": 3, "disable_by_batch_size": 8},
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
     "disable_by_batch_size": 8},
])
def test_speculative_decoding_gives_the_plain_tokens(plain, spec: dict) -> None:
    with LLM(**ENGINE, speculative_config=spec) as llm:
        assert _run(llm) == plain
        assert llm.engine.scheduler.spec.num_draft_tokens > 0
