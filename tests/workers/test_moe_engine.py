"""The embedded `qwen3-moe-tiny` through the offline LLM: the engine paths the dense model has
(prefix caching, async scheduling, swap preemption, structured outputs, Ray tp 2 with EP)
give transformers' greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch

from cluster import LLM, SamplingParams, StructuredOutputsParams
from workers.tiny_model import TINY_MOE_MODEL_NAME, resolve_model

MAX_NEW = 10


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(100, 150000) for _ in range(40)]  # 2.5 blocks shared
    return [shared + [rng.randrange(100, 150000) for _ in range(k)] for k in (2, 13)] + \
        [[rng.randrange(100, 150000) for _ in range(k)] for k in (4, 27)]


def _growing_prompts() -> list[list[int]]:
    """Four 2-block prompts that grow to 4 blocks each: 6 KV blocks cannot hold them all."""
    rng = random.Random(6)
    return [[rng.randrange(100, 150000) for _ in range(20 + i)] for i in range(4)]


LONG_NEW = 30


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model(TINY_MOE_MODEL_NAME))

    def greedy(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        with torch.no_grad():
            return [model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False)
                    [0, len(p):].tolist() for p in prompts]

    return greedy


@pytest.fixture(scope="module")
def oracle(hf) -> list[list[int]]:
    return hf(_prompts(), MAX_NEW)


def _greedy(llm: LLM, prompts: list[list[int]] | None = None, max_new: int = MAX_NEW
            ) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts or _prompts()],
                        SamplingParams(temperature=0.0, max_tokens=max_new), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_offline_llm_prefix_cache_async_and_structured(oracle) -> None:
    with LLM(TINY_MOE_MODEL_NAME, max_num_seqs=8, max_num_batched_tokens=64,
             async_scheduling=True) as llm:
        assert _greedy(llm) == oracle
        assert llm.engine.scheduler.kv.stats().prefix_hits >= 32
        choice = llm.generate("Pick one:", SamplingParams(
            temperature=0.0, max_tokens=8,
            structured_outputs=StructuredOutputsParams(choice=["red", "green"])),
            use_tqdm=False)
        assert choice[0].outputs[0].text in ("red", "green")


def test_offline_llm_swap_preemption(hf) -> None:
    with LLM(TINY_MOE_MODEL_NAME, num_gpu_blocks_override=6, swap_space=0.01,
             preemption_mode="swap") as llm:
        assert _greedy(llm, _growing_prompts(), LONG_NEW) == hf(_growing_prompts(), LONG_NEW)
        assert llm.engine.scheduler.stats().preemptions_swap > 0


@pytest.fixture
def local_ray():
    """Ray for a tp-2 engine: the session's cluster where a test before started one, else a
    local one of this test's own, stopped after it. (The engine's own `ray.init()` would join
    whatever cluster Ray's current-cluster file names, which on a shared machine may be
    another session's: this test hung 13 minutes connecting to one when run alone.)"""
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init("local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ray_tp2_expert_parallel(oracle, local_ray) -> None:
    with LLM(TINY_MOE_MODEL_NAME, tensor_parallel_size=2, enable_expert_parallel=True,
             max_num_seqs=8, max_num_batched_tokens=64) as llm:
        assert _greedy(llm) == oracle
