"""The decode fast paths (the common one-token decode in schedule, the plain rows in
apply_result and in the output processor) give exactly the outputs and plans of the general
path."""

import numpy as np
from scheduler_harness import Core

from kvcache import KVCacheManager
from scheduler import (
    CompletionOutput,
    RequestOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepResult,
)


def _sched(max_model_len: int = 64) -> Core:
    kv = KVCacheManager(num_gpu_blocks=32, num_cpu_blocks=0, block_size=4)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=max_model_len)
    return Core(Scheduler(cfg, kv, eos_token_ids=[1]))


def _step(s: Core, tokens: dict[int, int]) -> list[RequestOutput]:
    plan = s.schedule()
    ids = plan.seq_ids[plan.do_sample]
    res = StepResult(plan.step_id, ids, np.array([tokens[i] for i in ids.tolist()], dtype=np.int64))
    return s.apply_result(plan, res)


def test_plain_decode_outputs_and_length_limit():
    s = _sched()
    s.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    s.add_request("b", [5, 6], SamplingParams(max_tokens=4, stop_token_ids=[42]))
    got = [_step(s, {0: 10 + k, 1: 20 + k}) for k in range(3)]
    assert got[0] == [RequestOutput("a", [5, 6, 7, 8, 9], [CompletionOutput(0, [10], "")], False),
                      RequestOutput("b", [5, 6], [CompletionOutput(0, [20], "")], False)]
    assert got[1][0].outputs == [CompletionOutput(0, [11], "", None, None, None)]
    assert got[2][0] == RequestOutput("a", [5, 6, 7, 8, 9],
                                      [CompletionOutput(0, [12], "", "length", None, None)], True)
    assert not got[2][1].finished and got[2][1].outputs[0].token_ids == [22]
    plan = s.schedule()  # "a" finished last step: this plan drops its seq
    assert plan.dropped_seq_ids == [0] and plan.seq_ids.tolist() == [1]
    last = s.apply_result(plan, StepResult(plan.step_id, plan.seq_ids, np.array([42])))  # the stop token id, on the 4th and last allowed token
    assert last == [RequestOutput("b", [5, 6], [CompletionOutput(0, [42], "", "stop", 42)], True)]
    assert not s.has_unfinished()
    plan = s.schedule()
    assert plan.is_empty and plan.dropped_seq_ids == [1]


def test_decode_plan_charges_budget_and_appends_blocks():
    s = _sched()
    for i in range(3):
        s.add_request(f"r{i}", [3] * 4, SamplingParams(max_tokens=20, ignore_eos=True))
    _step(s, {0: 7, 1: 7, 2: 7})  # prefill: one full block each, the 4th slot is the last
    plan = s.schedule()
    assert plan.seq_ids.tolist() == [0, 1, 2] and plan.start_pos.tolist() == [4, 4, 4]
    assert plan.input_ids.tolist() == [7, 7, 7] and plan.query_lens.tolist() == [1, 1, 1]
    assert plan.appended_blocks == {0: [3], 1: [4], 2: [5]}
    s.apply_result(plan, StepResult(plan.step_id, plan.seq_ids, np.array([8, 8, 8])))
    plan = s.schedule()
    assert plan.start_pos.tolist() == [5, 5, 5] and plan.appended_blocks == {}
    assert plan.input_ids.tolist() == [8, 8, 8]


def test_plain_parallel_sampling_groups_outputs_per_request():
    s = _sched()
    s.add_request("p", [5, 6, 7], SamplingParams(n=2, max_tokens=2, ignore_eos=True))
    _step(s, {})  # the parent computes the prompt but its last token
    first = _step(s, {0: 30, 1: 31})
    assert first == [RequestOutput("p", [5, 6, 7], [CompletionOutput(0, [30], ""),
                                                    CompletionOutput(1, [31], "")], False)]
    second = _step(s, {0: 40, 1: 41})
    assert second[0].finished
    assert sorted((c.index, c.token_ids, c.finish_reason) for c in second[0].outputs) == [
        (0, [40], "length"), (1, [41], "length")]
