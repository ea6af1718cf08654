"""Exact plans for hand-built scenarios (block size 4, fake model, fake worker)."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_harness import (
    check_consistency,
    make,
    next_token,
    reference_tokens,
    run_to_completion,
    step,
)

from scheduler import SamplingParams, StepPlan

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def summary(plan: StepPlan) -> dict:
    """The plan as plain values, empty fields left out."""
    d = {
        "seqs": plan.seq_ids.tolist(), "q": plan.query_lens.tolist(),
        "start": plan.start_pos.tolist(), "ids": plan.input_ids.tolist(),
        "sample": plan.do_sample.tolist(),
        "new": [(n.seq_id, n.seq_index, n.prompt_len, n.computed_token_ids, n.block_table)
                for n in plan.new_seqs],
        "append": plan.appended_blocks, "replace": plan.replaced_tables,
        "drop": plan.dropped_seq_ids, "swap_out": plan.swap_out.tolist(),
        "swap_in": plan.swap_in.tolist(), "copies": plan.copies.tolist(),
    }
    return {k: v for k, v in d.items() if v not in ([], {})}


def test_chunked_prefill_splits_a_long_prompt_across_steps() -> None:
    sched, kv, worker = make(num_gpu_blocks=16, max_num_batched_tokens=8, max_num_seqs=4)
    prompt = list(range(100, 120))
    sched.add_request("a", prompt, SamplingParams(max_tokens=2, **GREEDY))
    t0 = next_token(prompt, 0)
    plans = [step(sched, worker)[0] for _ in range(5)]
    assert [summary(p) for p in plans] == [
        {"seqs": [0], "q": [8], "start": [0], "ids": prompt[:8], "sample": [False],
         "new": [(0, 0, 20, [], [0, 1])]},
        {"seqs": [0], "q": [8], "start": [8], "ids": prompt[8:16], "sample": [False],
         "append": {0: [2, 3]}},
        {"seqs": [0], "q": [4], "start": [16], "ids": prompt[16:], "sample": [True],
         "append": {0: [4]}},
        {"seqs": [0], "q": [1], "start": [20], "ids": [t0], "sample": [True], "append": {0: [5]}},
        {"drop": [0]},
    ]
    assert plans[4].is_empty and not sched.has_unfinished()


def test_without_chunking_a_prompt_waits_for_a_step_with_room() -> None:
    sched, kv, worker = make(num_gpu_blocks=16, max_num_batched_tokens=12, max_num_seqs=4,
                             max_model_len=12, enable_chunked_prefill=False)
    sched.add_request("a", list(range(100, 105)), SamplingParams(max_tokens=3, **GREEDY))
    step(sched, worker)
    sched.add_request("b", list(range(200, 211)), SamplingParams(max_tokens=1, **GREEDY))
    plan, _ = step(sched, worker)  # 1 decode + 11 prompt tokens = 12: fits
    assert summary(plan)["q"] == [1, 11]
    sched.add_request("c", list(range(300, 311)), SamplingParams(max_tokens=1, **GREEDY))
    plan, _ = step(sched, worker)  # a decodes, c's whole prompt fills the other 11
    assert summary(plan)["q"] == [1, 11]
    sched.add_request("d", list(range(400, 411)), SamplingParams(max_tokens=1, **GREEDY))
    sched.add_request("e", list(range(500, 502)), SamplingParams(max_tokens=1, **GREEDY))
    plan, _ = step(sched, worker)  # a finished: d (11) runs; e (2) waits behind it (FCFS)
    assert summary(plan)["seqs"] == [3] and summary(plan)["q"] == [11]
    plan, _ = step(sched, worker)
    assert summary(plan)["seqs"] == [4] and summary(plan)["q"] == [2]


def test_decodes_come_first_then_prefill_chunks_use_the_rest_of_the_budget() -> None:
    sched, kv, worker = make(num_gpu_blocks=16, max_num_batched_tokens=8, max_num_seqs=4)
    a_prompt, b_prompt = list(range(100, 106)), list(range(200, 212))
    sched.add_request("a", a_prompt, SamplingParams(max_tokens=4, **GREEDY))
    step(sched, worker)
    sched.add_request("b", b_prompt, SamplingParams(max_tokens=1, **GREEDY))
    a_out = reference_tokens(a_prompt, SamplingParams(max_tokens=4, **GREEDY), 0, 4096)
    plans = [step(sched, worker)[0] for _ in range(3)]
    assert [summary(p) for p in plans] == [
        {"seqs": [0, 1], "q": [1, 7], "start": [6, 0], "ids": [a_out[0]] + b_prompt[:7],
         "sample": [True, False], "new": [(1, 0, 12, [], [2, 3])]},
        {"seqs": [0, 1], "q": [1, 5], "start": [7, 7], "ids": [a_out[1]] + b_prompt[7:],
         "sample": [True, True], "append": {1: [4]}},
        {"seqs": [0], "q": [1], "start": [8], "ids": [a_out[2]], "sample": [True],
         "append": {0: [5]}, "drop": [1]},
    ]


def test_prefix_hit_skips_cached_blocks_and_reports_cached_tokens() -> None:
    sched, kv, worker = make(num_gpu_blocks=16, max_num_batched_tokens=16, max_num_seqs=4)
    sched.add_request("a", list(range(100, 110)), SamplingParams(max_tokens=1, **GREEDY))
    step(sched, worker)
    step(sched, worker)  # drops a
    b_prompt = list(range(100, 108)) + [300, 301, 302]
    sched.add_request("b", b_prompt, SamplingParams(max_tokens=1, **GREEDY))
    plan, outs = step(sched, worker)
    assert summary(plan) == {
        "seqs": [1], "q": [3], "start": [8], "ids": [300, 301, 302], "sample": [True],
        "new": [(1, 0, 11, list(range(100, 108)), [0, 1, 2])]}
    assert outs[0].num_cached_tokens == 8
    assert outs[0].outputs[0].token_ids == [next_token(b_prompt, 0)]
    stats = sched.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (21, 8)
    assert stats.prefix_hit_rate == 8 / 21


def test_prefix_hit_on_blocks_computed_in_the_same_step() -> None:
    sched, kv, worker = make(num_gpu_blocks=16, max_num_batched_tokens=32, max_num_seqs=4)
    shared = list(range(100, 108))
    sched.add_request("a", shared + [1000, 1001], SamplingParams(max_tokens=1, **GREEDY))
    sched.add_request("b", shared + [2000], SamplingParams(max_tokens=1, **GREEDY))
    plan, outs = step(sched, worker)
    # b hits the two blocks a fills in this very step (workers write the batch's KV before
    # attending); its one remaining token samples, so it is a decode and goes first.
    assert summary(plan) == {
        "seqs": [1, 0], "q": [1, 10], "start": [8, 0],
        "ids": [2000] + shared + [1000, 1001], "sample": [True, True],
        "new": [(0, 0, 10, [], [0, 1, 2]), (1, 0, 9, shared, [0, 1, 3])]}
    assert [o.outputs[0].token_ids for o in outs] == [[next_token(shared + [2000], 0)],
                                                       [next_token(shared + [1000, 1001], 0)]]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_most_recently_admitted_request_is_preempted_then_resumes(mode: str) -> None:
    swap = mode == "swap"
    sched, kv, worker = make(num_gpu_blocks=4, num_cpu_blocks=8 if swap else 0,
                             max_num_batched_tokens=16, max_num_seqs=4, preemption_mode=mode)
    a_prompt, b_prompt = list(range(100, 107)), list(range(200, 208))
    a_sp, b_sp = SamplingParams(max_tokens=4, **GREEDY), SamplingParams(max_tokens=3, **GREEDY)
    a_out, b_out = reference_tokens(a_prompt, a_sp, 0, 4096), reference_tokens(b_prompt, b_sp, 0, 4096)
    sched.add_request("a", a_prompt, a_sp)
    step(sched, worker)
    sched.add_request("b", b_prompt, b_sp)
    plans = [step(sched, worker)[0] for _ in range(6)]
    got = [summary(p) for p in plans]
    # b takes the last two blocks; a then needs a block for position 8 and b, admitted last
    # and not yet scheduled in that step, is preempted.
    assert got[0] == {"seqs": [0, 1], "q": [1, 8], "start": [7, 0], "ids": [a_out[0]] + b_prompt,
                      "sample": [True, True], "new": [(1, 0, 8, [], [2, 3])]}
    preempted = {"seqs": [0], "q": [1], "start": [8], "ids": [a_out[1]], "sample": [True],
                 "append": {0: [3]}, "drop": [1]}
    if swap:
        preempted["swap_out"] = [[2, 0], [3, 1]]
    assert got[1] == preempted
    assert got[2] == {"seqs": [0], "q": [1], "start": [9], "ids": [a_out[2]], "sample": [True]}
    if swap:
        # a finished; b is swapped back in and sent again in full, then decodes.
        assert got[3] == {"seqs": [1], "q": [1], "start": [8], "ids": [b_out[0]],
                          "sample": [True], "drop": [0], "swap_in": [[0, 3], [1, 2]],
                          "new": [(1, 0, 8, b_prompt, [3, 2, 1])]}
        assert sched.stats().preemptions_swap == 1
    else:
        # b recomputes prompt + its first output; its first block is still cached.
        assert got[3] == {"seqs": [1], "q": [5], "start": [4], "ids": b_prompt[4:] + [b_out[0]],
                          "sample": [True], "drop": [0],
                          "new": [(1, 0, 8, b_prompt[:4], [2, 3, 1])]}
        assert sched.stats().preemptions_recompute == 1
    assert got[4] == {"seqs": [1], "q": [1], "start": [9], "ids": [b_out[1]], "sample": [True]}
    assert got[5] == {"drop": [1]}
    assert kv.num_free_gpu_blocks == 4 and kv.num_free_cpu_blocks == kv.num_cpu_blocks


def test_swap_resumes_before_new_requests_are_admitted() -> None:
    sched, kv, worker = make(num_gpu_blocks=4, num_cpu_blocks=8, max_num_batched_tokens=16,
                             max_num_seqs=4)
    sched.add_request("a", list(range(100, 107)), SamplingParams(max_tokens=4, **GREEDY))
    step(sched, worker)
    sched.add_request("b", list(range(200, 208)), SamplingParams(max_tokens=3, **GREEDY))
    step(sched, worker)
    step(sched, worker)  # b swapped out
    assert [r.request_id for r in sched.queues.swapped] == ["b"]
    sched.add_request("c", [5, 6], SamplingParams(max_tokens=1, **GREEDY))
    plan, _ = step(sched, worker)  # one free block: c would fit, but b is first in line
    assert summary(plan)["seqs"] == [0]
    plan, _ = step(sched, worker)  # a finished: b comes back, then c
    assert summary(plan)["seqs"] == [1, 2] and summary(plan)["swap_in"] == [[0, 3], [1, 2]]


def test_request_alone_that_outgrows_the_cache_finishes_with_length() -> None:
    sched, kv, worker = make(num_gpu_blocks=2, max_num_batched_tokens=8, max_num_seqs=2)
    sched.add_request("a", [5, 6, 7], SamplingParams(max_tokens=20, **GREEDY))
    got = run_to_completion(sched, kv, worker)
    # 8 slots in the cache: positions 0..7 computed, so 9 tokens in all, 6 of them outputs.
    assert got[("a", 0)].token_ids == reference_tokens([5, 6, 7], SamplingParams(
        max_tokens=6, **GREEDY), 0, 4096)
    assert got[("a", 0)].finish_reason == "length"


def test_n2_forks_after_prefill_and_copies_the_shared_last_block_on_write() -> None:
    sched, kv, worker = make(num_gpu_blocks=8, max_num_batched_tokens=8, max_num_seqs=4)
    prompt = list(range(100, 106))
    sp = SamplingParams(n=2, max_tokens=3, **GREEDY)
    sched.add_request("a", prompt, sp)
    out0, out1 = (reference_tokens(prompt, sp, i, 4096) for i in (0, 1))
    assert out0 != out1
    plans = [step(sched, worker)[0] for _ in range(5)]
    assert [summary(p) for p in plans] == [
        # The parent computes the prompt but its last token, without sampling.
        {"seqs": [0], "q": [5], "start": [0], "ids": prompt[:5], "sample": [False],
         "new": [(0, 0, 6, [], [0, 1])]},
        # Fork: both compute the last prompt token; the child copies the shared block 1.
        {"seqs": [0, 1], "q": [1, 1], "start": [5, 5], "ids": [105, 105], "sample": [True, True],
         "new": [(1, 1, 6, prompt[:5], [0, 2])], "copies": [[1, 2]]},
        {"seqs": [0, 1], "q": [1, 1], "start": [6, 6], "ids": [out0[0], out1[0]],
         "sample": [True, True]},
        {"seqs": [0, 1], "q": [1, 1], "start": [7, 7], "ids": [out0[1], out1[1]],
         "sample": [True, True]},
        {"drop": [0, 1]},
    ]
    assert kv.num_free_gpu_blocks == 8


def test_n3_fork_on_a_block_boundary_gives_each_sequence_a_new_block() -> None:
    sched, kv, worker = make(num_gpu_blocks=8, max_num_batched_tokens=8, max_num_seqs=4)
    prompt = list(range(100, 105))
    sched.add_request("a", prompt, SamplingParams(n=3, max_tokens=2, **GREEDY))
    step(sched, worker)
    plan, outs = step(sched, worker)
    assert summary(plan) == {
        "seqs": [0, 1, 2], "q": [1, 1, 1], "start": [4, 4, 4], "ids": [104] * 3,
        "sample": [True] * 3, "append": {0: [3]},
        "new": [(1, 1, 5, prompt[:4], [0, 1]), (2, 2, 5, prompt[:4], [0, 2])]}
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert [c.token_ids[0] for c in outs[0].outputs] == [next_token(prompt, i) for i in range(3)]


def test_one_token_prompt_with_n2_starts_independent_sequences() -> None:
    sched, kv, worker = make(num_gpu_blocks=8, max_num_batched_tokens=8, max_num_seqs=4)
    sched.add_request("a", [42], SamplingParams(n=2, max_tokens=2, **GREEDY))
    plan, _ = step(sched, worker)
    assert summary(plan) == {"seqs": [0, 1], "q": [1, 1], "start": [0, 0], "ids": [42, 42],
                             "sample": [True, True],
                             "new": [(0, 0, 1, [], [0]), (1, 1, 1, [], [1])]}


# ---- abort ----------------------------------------------------------------------------------


def _two_requests(**kw: object):
    sched, kv, worker = make(num_gpu_blocks=4, num_cpu_blocks=8, max_num_batched_tokens=16,
                             max_num_seqs=4, **kw)
    sched.add_request("a", list(range(100, 107)), SamplingParams(max_tokens=4, **GREEDY))
    step(sched, worker)
    sched.add_request("b", list(range(200, 208)), SamplingParams(max_tokens=3, **GREEDY))
    return sched, kv, worker


def test_abort_waiting_request_frees_nothing_and_drops_nothing() -> None:
    sched, kv, worker = make(num_gpu_blocks=8, max_num_batched_tokens=8, max_num_seqs=4)
    sched.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, logprobs=1, **GREEDY))
    out = sched.abort("a")
    assert out.request_id == "a" and out.finished and out.prompt_token_ids == [5, 6, 7]
    assert [(c.index, c.token_ids, c.text, c.finish_reason, c.logprobs) for c in out.outputs] \
        == [(0, [], "", "abort", [])]
    assert sched.abort("a") is None and sched.abort("nope") is None
    plan, _ = step(sched, worker)
    assert summary(plan) == {} and not sched.has_unfinished()


def test_abort_mid_prefill_frees_blocks_at_once_and_drops_next_plan() -> None:
    sched, kv, worker = make(num_gpu_blocks=8, max_num_batched_tokens=4, max_num_seqs=4)
    sched.add_request("a", list(range(100, 110)), SamplingParams(max_tokens=4, **GREEDY))
    step(sched, worker)
    assert kv.num_free_gpu_blocks == 7
    assert sched.abort("a").outputs[0].finish_reason == "abort"
    assert kv.num_free_gpu_blocks == 8
    plan, _ = step(sched, worker)
    assert summary(plan) == {"drop": [0]}
    assert worker.seqs == {}


def test_abort_while_decoding_and_while_its_step_is_in_flight() -> None:
    sched, kv, worker = make(num_gpu_blocks=8, max_num_batched_tokens=8, max_num_seqs=4)
    sched.add_request("a", [5, 6, 7], SamplingParams(max_tokens=8, **GREEDY))
    sched.add_request("b", [8, 9], SamplingParams(max_tokens=2, **GREEDY))
    step(sched, worker)
    plan = sched.schedule()
    result = worker.execute(plan)
    sched.abort("a")  # while the step runs: its token is ignored
    outs = sched.apply_result(plan, result)
    assert [o.request_id for o in outs] == ["b"]
    plan, _ = step(sched, worker)
    assert summary(plan) == {"drop": [0, 1]}
    assert kv.num_free_gpu_blocks == 8


def test_abort_swapped_request_frees_its_cpu_blocks() -> None:
    sched, kv, worker = _two_requests()
    step(sched, worker)
    step(sched, worker)  # b swapped out
    assert kv.num_free_cpu_blocks == 6
    out = sched.abort("b")
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    assert kv.num_free_cpu_blocks == 8 and not sched.queues.swapped
    plan, _ = step(sched, worker)
    assert "drop" not in summary(plan)  # b's worker state went with the swap-out


def test_abort_recompute_preempted_request() -> None:
    sched, kv, worker = _two_requests(preemption_mode="recompute")
    step(sched, worker)
    step(sched, worker)  # b preempted for recompute: back in waiting, no blocks
    assert [r.request_id for r in sched.queues.waiting] == ["b"]
    sched.abort("b")
    assert not sched.queues.waiting and kv.num_free_gpu_blocks == 1  # a holds 3 blocks
    got = run_to_completion(sched, kv, worker)
    assert got[("a", 0)].finish_reason == "length"
    assert kv.num_free_gpu_blocks == 4


def test_n2_abort_after_one_sequence_finished() -> None:
    sched, kv, worker = make(num_gpu_blocks=8, max_num_batched_tokens=8, max_num_seqs=4)
    prompt = [3, 4, 5]
    free_run = SamplingParams(n=2, max_tokens=6, **GREEDY)
    out0, out1 = (reference_tokens(prompt, free_run, i, 4096) for i in (0, 1))
    stop = out1[1]  # sequence 1 stops at its second token, sequence 0 runs on
    assert stop not in out0
    sched.add_request("a", prompt, SamplingParams(n=2, max_tokens=6, stop_token_ids=[stop],
                                                  **GREEDY))
    outs = [step(sched, worker)[1] for _ in range(4)]
    assert [(c.index, c.token_ids, c.finish_reason, c.stop_reason) for c in outs[2][0].outputs] \
        == [(0, [out0[1]], None, None), (1, [stop], "stop", stop)]
    out = sched.abort("a")
    assert [(c.index, c.finish_reason) for c in out.outputs] == [(0, "abort")]
    plan, _ = step(sched, worker)
    assert summary(plan) == {"drop": [0]}  # seq 1 was dropped when it stopped
    assert kv.num_free_gpu_blocks == 8 and worker.seqs == {}


# ---- protocol -------------------------------------------------------------------------------


def test_at_most_two_plans_in_flight_applied_in_order() -> None:
    sched, kv, worker = make()
    sched.add_request("a", [5, 6], SamplingParams(max_tokens=3, **GREEDY))
    first = sched.schedule()
    second = sched.schedule()  # async scheduling: one ahead of the first's result
    with pytest.raises(RuntimeError, match="at most 2 plans"):
        sched.schedule()
    results = [worker.execute(first), worker.execute(second)]
    with pytest.raises(RuntimeError, match="apply them in order"):
        sched.apply_result(second, results[1])
    with pytest.raises(ValueError, match="no StepResult"):
        sched.apply_result(first, None)
    sched.apply_result(first, results[0])
    sched.apply_result(second, results[1])
    check_consistency(sched, kv, worker)


def test_plan_arrays_have_the_documented_dtypes() -> None:
    sched, kv, worker = make()
    sched.add_request("a", [5, 6, 7, 8, 9], SamplingParams(n=2, max_tokens=2, **GREEDY))
    plan = sched.schedule()
    assert plan.seq_ids.dtype == np.int64 and plan.input_ids.dtype == np.int64
    assert plan.query_lens.dtype == np.int32 and plan.start_pos.dtype == np.int32
    assert plan.do_sample.dtype == np.bool_ and plan.copies.shape == (0, 2)


def test_swapped_request_over_the_watermark_on_an_idle_gpu_is_recomputed() -> None:
    sched, kv, worker = make(num_gpu_blocks=8, num_cpu_blocks=16, watermark=0.25,
                             max_num_batched_tokens=8, max_num_seqs=2)
    b_prompt = list(range(200, 227))
    sched.add_request("a", [5], SamplingParams(max_tokens=6, **GREEDY))
    sched.add_request("b", b_prompt, SamplingParams(max_tokens=2, **GREEDY))
    plans = [step(sched, worker)[0] for _ in range(8)]
    # b fills 7 of the 8 blocks; a's next block preempts it to CPU.
    assert summary(plans[4])["swap_out"] == [[1, 0], [2, 1], [3, 2], [4, 3], [5, 4], [6, 5],
                                             [7, 6]]
    assert sched.stats().preemptions_swap == 1
    # With a done the GPU is idle, yet 8 - 7 blocks would leave less than the 2-block
    # watermark: b is recomputed instead, hitting its own blocks still cached on the GPU.
    b_out0 = reference_tokens(b_prompt, SamplingParams(max_tokens=2, **GREEDY), 0, 4096)[0]
    assert summary(plans[6]) == {
        "seqs": [1], "q": [4], "start": [24], "ids": b_prompt[24:] + [b_out0], "sample": [True],
        "new": [(1, 0, 27, b_prompt[:24], [1, 2, 3, 4, 5, 6, 7])], "drop": [0]}
    assert summary(plans[7]) == {"drop": [1]}
    assert kv.num_free_gpu_blocks == 8 and kv.num_free_cpu_blocks == 16


def test_apply_result_checks_it_answers_the_plan() -> None:
    sched, kv, worker = make(max_num_batched_tokens=4, max_num_seqs=4)
    sched.add_request("a", list(range(100, 106)), SamplingParams(max_tokens=1, **GREEDY))
    plan = sched.schedule()  # a 4-token chunk: nobody samples, no StepResult needed
    assert plan.do_sample.tolist() == [False]
    worker.execute(plan)
    with pytest.raises(RuntimeError, match="apply_result"):
        sched.apply_result(StepPlan(99, *([np.zeros(0)] * 5)), None)
    assert sched.apply_result(plan, None) == []
    plan = sched.schedule()
    assert plan.do_sample.tolist() == [True]
    bad = worker.execute(plan)
    bad.seq_ids, bad.token_ids = bad.seq_ids[:0], bad.token_ids[:0]
    with pytest.raises(ValueError, match="does not answer plan"):
        sched.apply_result(plan, bad)
