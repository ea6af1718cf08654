"""Pipeline parallelism on one node (the shared `ray_cluster`): micro-batches (two plans of
disjoint sequences in flight at pp 2, scheduler/ahead.py), with async scheduling on or off,
give transformers' greedy tokens with chunked prefill beside decodes, a prefix hit, and a
constrained request whose bitmask goes to the last stage once every plan before its own has
been applied."""

from __future__ import annotations

import random

import pytest
import torch

from cluster import LLM, SamplingParams, StructuredOutputsParams
from workers.tiny_model import TINY_MODEL_NAME, resolve_model

pytestmark = pytest.mark.slow


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(100, 150000) for _ in range(40)]
    return [shared + [rng.randrange(100, 150000) for _ in range(k)] for k in (3, 30)] + \
        [[rng.randrange(100, 150000) for _ in range(k)] for k in (5, 21)]


def test_pp2_async_scheduling_chunked_prefix_and_structured(ray_cluster: None) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model(TINY_MODEL_NAME))
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)
                [0, len(p):].tolist() for p in _prompts()]
    with LLM(TINY_MODEL_NAME, pipeline_parallel_size=2, device="cpu", worker_num_cpus=0.5,
             max_num_seqs=8, max_model_len=256, max_num_batched_tokens=32, swap_space=0.01,
             async_scheduling=True) as llm:
        assert llm.engine.async_scheduling
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.scheduler.kv.stats().prefix_hits >= 32
        colours = ["red", "green", "blue"]
        constrained = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=(
            StructuredOutputsParams(choice=colours)))
        (out,) = llm.generate("Pick one:", constrained, use_tqdm=False)
        assert out.outputs[0].text in colours


def test_pp2_micro_batches_keep_two_plans_in_flight(ray_cluster: None) -> None:
    """24 requests over max_num_seqs 16: each plan takes at most 8 sequences, so two disjoint
    plans are in flight (the engine's max_plans_in_flight metric), with chunked prefill and a
    constrained request among them."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(5)
    prompts = [[rng.randrange(100, 150000) for _ in range(rng.randrange(4, 40))]
               for _ in range(24)]
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(TINY_MODEL_NAME))
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)
                [0, len(p):].tolist() for p in prompts]
    colours = ["red", "green", "blue"]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=(
        StructuredOutputsParams(choice=colours)))
    with LLM(TINY_MODEL_NAME, pipeline_parallel_size=2, device="cpu", worker_num_cpus=0.5,
             max_num_seqs=16, max_model_len=256, max_num_batched_tokens=32,
             async_scheduling=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:12]] + ["Pick one:"]
                            + [{"prompt_token_ids": p} for p in prompts[12:]],
                            [greedy] * 12 + [constrained] + [greedy] * 12, use_tqdm=False)
        assert outs[12].outputs[0].text in colours
        del outs[12]
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.metrics()["max_plans_in_flight"] == 2
