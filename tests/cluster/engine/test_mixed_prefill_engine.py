"""max_mixed_prefill_tokens on the real engine: prompts arriving while others decode are
prefilled a capped chunk at a time beside the decodes, and greedy tokens stay transformers'."""

from __future__ import annotations

import pytest
from test_llm import MAX_NEW, _hf_greedy, _prompts

from cluster.engine.llm import LLM
from scheduler import SamplingParams, StepPlan

CAP = 8


@pytest.fixture(scope="module")
def oracle(tiny_model_path: str) -> list[list[int]]:
    return _hf_greedy(tiny_model_path, _prompts(), MAX_NEW)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_capped_prefill_beside_decodes_keeps_transformers_tokens(
        oracle: list[list[int]], async_scheduling: bool) -> None:
    with LLM("qwen3-tiny", max_num_seqs=8, max_num_batched_tokens=64,
             max_mixed_prefill_tokens=CAP, async_scheduling=async_scheduling) as llm:
        engine = llm.engine
        plans: list[StepPlan] = []
        schedule = engine.scheduler.schedule

        def recording() -> StepPlan:
            plans.append(schedule())
            return plans[-1]

        engine.scheduler.schedule = recording
        # Two requests first, then the rest join while those two decode.
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
        prompts = _prompts()
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}

        def step() -> None:  # (outputs are deltas)
            for out in engine.step():
                got[out.request_id] += out.outputs[0].token_ids

        for i, p in enumerate(prompts[:2]):
            engine.add_request(f"r{i}", p, params)
        step()
        for i, p in enumerate(prompts[2:], start=2):
            engine.add_request(f"r{i}", p, params)
        while engine.has_unfinished():
            step()
        assert [got[f"r{i}"] for i in range(len(prompts))] == oracle
        mixed = [p for p in plans if (p.query_lens == 1).any() and (p.query_lens > 1).any()]
        assert mixed, "no step prefilled beside decodes"
        for p in mixed:
            assert int(p.query_lens[p.query_lens > 1].sum()) <= CAP
        # With no decodes yet, the first step filled the whole budget (57 + 7 of 65 tokens).
        assert plans[0].query_lens.tolist() == [57, 7]
