"""max_mixed_prefill_tokens: a step that carries decodes computes at most that many prompt
tokens; a step without decodes still fills max_num_batched_tokens (block size 4, fake model,
fake worker)."""

from __future__ import annotations

import pytest
from scheduler_harness import make, reference_tokens, run_to_completion, step

from cluster.engine.config import EngineConfig
from scheduler import SamplingParams, SchedulerConfig

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_prompt_beside_decodes_gets_at_most_the_cap_and_alone_the_whole_budget() -> None:
    sched, kv, worker = make(num_gpu_blocks=32, max_num_batched_tokens=8, max_num_seqs=4,
                             max_mixed_prefill_tokens=3)
    a_prompt, b_prompt = list(range(100, 106)), list(range(200, 212))
    sp_a, sp_b = SamplingParams(max_tokens=6, **GREEDY), SamplingParams(max_tokens=2, **GREEDY)
    sched.add_request("a", a_prompt, sp_a)
    tokens: dict[str, list[int]] = {"a": [], "b": []}

    def run() -> list[int]:
        plan, outs = step(sched, worker)
        for out in outs:
            tokens[out.request_id] += out.outputs[0].token_ids
        return plan.query_lens.tolist()

    assert run() == [6]  # no decodes yet: the whole prompt in one step
    sched.add_request("b", b_prompt, sp_b)
    # a decodes every step (first in the batch); b's 12 prompt tokens go 3 at a time, where
    # the uncapped budget would have given it 7 and then 5
    assert [run() for _ in range(4)] == [[1, 3], [1, 3], [1, 3], [1, 3]]
    assert run() == [1, 1]  # both decode: b sampled with its last chunk
    while sched.has_unfinished():
        run()
    assert tokens == {"a": reference_tokens(a_prompt, sp_a, 0, 4096),
                      "b": reference_tokens(b_prompt, sp_b, 0, 4096)}


def test_with_the_cap_every_request_still_generates_what_it_would_without() -> None:
    prompts = [list(range(100 + 40 * i, 100 + 40 * i + 5 + 7 * i)) for i in range(5)]
    sp = SamplingParams(max_tokens=9, **GREEDY)
    sched, kv, worker = make(num_gpu_blocks=64, max_num_batched_tokens=16, max_num_seqs=4,
                             max_mixed_prefill_tokens=2)
    for i, prompt in enumerate(prompts):
        sched.add_request(f"r{i}", prompt, sp)
    got = run_to_completion(sched, kv, worker)
    for i, prompt in enumerate(prompts):
        assert list(got[(f"r{i}", 0)].token_ids) == reference_tokens(prompt, sp, 0, 4096)


def test_every_step_with_decodes_stays_under_the_cap() -> None:
    sched, kv, worker = make(num_gpu_blocks=64, max_num_batched_tokens=16, max_num_seqs=8,
                             max_mixed_prefill_tokens=5)
    for i in range(6):
        sched.add_request(f"r{i}", list(range(100 + 30 * i, 120 + 30 * i)),
                          SamplingParams(max_tokens=4, **GREEDY))
    seen_mixed = 0
    while sched.has_unfinished():
        plan, _ = step(sched, worker)
        q = plan.query_lens
        prompt_tokens = int(q[q > 1].sum())
        if (q == 1).any() and prompt_tokens:
            seen_mixed += 1
            assert prompt_tokens <= 5
        assert int(q.sum()) <= 16
    assert seen_mixed >= 3


@pytest.mark.parametrize("cap, match", [
    (0, "max_mixed_prefill_tokens must be an integer in \\[1, max_num_batched_tokens = 8\\]"),
    (9, "max_mixed_prefill_tokens must be an integer in \\[1, max_num_batched_tokens = 8\\]"),
    (True, "got True"),
    (2.5, "got 2.5"),
])
def test_a_cap_outside_the_budget_is_refused(cap: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_mixed_prefill_tokens=cap)


def test_the_cap_needs_chunked_prefill() -> None:
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                        enable_chunked_prefill=False, max_mixed_prefill_tokens=8)


def test_engine_config_checks_the_cap_before_any_work() -> None:
    with pytest.raises(ValueError, match=r"max_mixed_prefill_tokens \(600\) must be <= "
                                         r"max_num_batched_tokens \(512\)"):
        EngineConfig(max_num_batched_tokens=512, max_mixed_prefill_tokens=600)
    with pytest.raises(ValueError, match="max_mixed_prefill_tokens must be an integer >= 1"):
        EngineConfig(max_mixed_prefill_tokens=0)
    assert EngineConfig(max_num_batched_tokens=512,
                        max_mixed_prefill_tokens=128).max_mixed_prefill_tokens == 128
