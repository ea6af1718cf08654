"""The CPU offload tier in the real engine (qwen3-tiny, fp32 CPU): greedy tokens equal with the
tier on and off on a multi-turn workload whose prefixes the tiny GPU pool evicts, and each bad
configuration is a clear error at start."""

from __future__ import annotations

import random

import pytest

from cluster import LLM, SamplingParams
from cluster.engine.config import EngineConfig

# A pool of 9 blocks of 16 tokens for three conversations of up to ~150 tokens each.
ENGINE = dict(model="qwen3-tiny", device="cpu", block_size=16, num_gpu_blocks_override=9,
              max_model_len=256, max_num_seqs=3, max_num_batched_tokens=48, swap_space=0.01)
TIER_GIB = 0.004  # ~130 blocks of qwen3-tiny


def _multi_turn(llm: LLM, turns: int = 4) -> list[list[list[int]]]:
    """Three conversations, turn by turn; per turn, every sample's tokens. Turn 1's long
    answers outgrow the pool (preemption); turn 2 samples n = 3; a turn's prompt is the
    conversation so far with the first 4 tokens of each answer."""
    rng = random.Random(7)
    history = [[rng.randrange(100, 150000) for _ in range(40)] for _ in range(3)]
    out = []
    for t in range(turns):
        for h in history:
            h += [rng.randrange(100, 150000) for _ in range(10)]
        # (turn 2's answers end in the prompt's last block: the n = 3 group fits the pool alone,
        # so no sample ends early for want of blocks, whatever the schedule)
        sp = SamplingParams(temperature=0, max_tokens={1: 40, 2: 2}.get(t, 8), ignore_eos=True,
                            n=3 if t == 2 else 1)
        res = llm.generate([{"prompt_token_ids": list(h)} for h in history], sp, use_tqdm=False)
        out.append([[c.token_ids for c in r.outputs] for r in res])
        for h, r in zip(history, res):
            h += r.outputs[0].token_ids[:4]
    kv = llm.engine.scheduler.kv
    kv.check_invariants()
    s = kv.stats()
    assert s.num_free_gpu_blocks == s.num_gpu_blocks and s.num_free_cpu_blocks == s.num_cpu_blocks
    return out


@pytest.fixture(scope="module")
def tier_off() -> list[list[list[int]]]:
    with LLM(**ENGINE, async_scheduling=False) as llm:
        return _multi_turn(llm)


@pytest.mark.parametrize(("async_scheduling", "preemption_mode"),
                         [(False, "swap"), (True, "recompute")])
def test_tier_on_gives_the_tier_off_tokens(tier_off, async_scheduling: bool,
                                           preemption_mode: str) -> None:
    with LLM(**ENGINE, kv_offloading_size=TIER_GIB, async_scheduling=async_scheduling,
             preemption_mode=preemption_mode) as llm:
        assert llm.engine.executor.num_offload_blocks == llm.engine.scheduler.kv.num_offload_blocks > 100
        assert _multi_turn(llm) == tier_off
        m = llm.engine.metrics()
        stats = llm.engine.scheduler.stats()
    assert m["kv_offload_blocks_offloaded"] > 0 and m["kv_offload_blocks_loaded"] > 0
    assert 0 < m["external_prefix_cache_hits"] <= m["external_prefix_cache_queries"]
    assert 0 < m["kv_offload_usage_perc"] <= 1
    assert stats.preemptions_swap + stats.preemptions_recompute > 0


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_tier_on_tp2_or_pp2_on_ray_gives_the_tier_off_tokens(ray_cluster: None, tier_off,
                                                            tp: int, pp: int) -> None:
    """Each rank offloads and loads its own shard of the KV heads (tp 2) or its stage's
    layers (pp 2); the scheduler decides."""
    with LLM(**ENGINE, tensor_parallel_size=tp, pipeline_parallel_size=pp, worker_num_cpus=0.5,
             kv_offloading_size=TIER_GIB, async_scheduling=False) as llm:
        assert _multi_turn(llm, turns=3) == tier_off[:3]
        assert llm.engine.metrics()["kv_offload_blocks_loaded"] > 0


def test_bad_tier_configurations_are_clear_errors_at_start() -> None:
    with pytest.raises(ValueError, match=r"kv_offloading_size must be >= 0 GiB .*got -1"):
        EngineConfig(kv_offloading_size=-1)
    with pytest.raises(ValueError, match="kv_offloading_size > 0 needs enable_prefix_caching"):
        EngineConfig(kv_offloading_size=1, enable_prefix_caching=False)
    cfg = EngineConfig(kv_offloading_size=20, swap_space=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"kv_offloading_size 20 GiB \+ swap_space 2 GiB x 2 "
                                         r"rank\(s\) \+ weights 1.00 GiB = 25.00 GiB exceeds "
                                         r"this host's 16.00 GiB of memory"):
        cfg.check_host_memory(1 << 30, 16 << 30)
    cfg.check_host_memory(1 << 30, 32 << 30)  # fits
    EngineConfig(swap_space=64).check_host_memory(1 << 30, 16 << 30)  # no tier: not its check
    with pytest.raises(ValueError, match="exceeds this host's"):  # before any worker starts
        LLM(**ENGINE, kv_offloading_size=1 << 20)
