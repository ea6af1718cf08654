"""Pipeline parallelism with async scheduling on one node (the shared `ray_cluster`): the
sampled ids of the last stage reach the first stage's pending tokens (workers/pipeline.py
`OutputBroadcast`), so greedy tokens are transformers' with chunked prefill beside decodes,
a prefix hit, and a constrained request whose bitmask goes to the last stage."""

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
