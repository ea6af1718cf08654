"""The decode lane (scheduler/decode_lane.py): running decodes scheduled in bulk, and their
tokens applied on the plain output path. Plans and outputs are those of one-by-one
scheduling, but for the batch order: the lane's rows come first."""

import sys

import numpy as np
import pytest
from scheduler_harness import Pipeline, check_consistency, make, step

from scheduler import CompletionOutput, RequestOutput, SamplingParams, StepResult


def _answer(plan, tokens: dict[int, int]) -> StepResult:
    ids = plan.seq_ids[plan.do_sample]
    return StepResult(plan.step_id, ids, np.array([tokens[i] for i in ids.tolist()],
                                                  dtype=np.int64))


def test_lane_rows_come_first_then_outside_decodes_then_prefill_chunks():
    sched, kv, worker = make(num_gpu_blocks=32, block_size=4, max_num_seqs=8,
                             max_num_batched_tokens=32, max_model_len=64)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    sched.add_request("a", [5, 6, 7], sp)
    sched.add_request("b", [8, 9, 10, 11], sp)
    plan, _ = step(sched, worker)  # both prefill and sample
    assert plan.seq_ids.tolist() == [0, 1] and len(sched.lane) == 0
    plan, _ = step(sched, worker)  # decoded one by one: both join the lane
    assert plan.seq_ids.tolist() == [0, 1] and sched.lane.seq_ids == [0, 1]
    assert sched.lane.steps == 0
    sched.add_request("c", [12, 13, 14, 15, 16], sp)
    plan, _ = step(sched, worker)  # the lane, then c's prefill
    assert sched.lane.steps == 1
    assert plan.seq_ids.tolist() == [0, 1, 2] and plan.query_lens.tolist() == [1, 1, 5]
    # a: 3 prompt + 2 outputs known, b: 4 + 2; slot 4 opens a's second block
    assert plan.start_pos.tolist() == [4, 5, 0]
    assert plan.input_ids.tolist()[:2] == [sched.queues.seqs[0][1].token_ids[4],
                                          sched.queues.seqs[1][1].token_ids[5]]
    assert list(plan.appended_blocks) == [0]
    plan, _ = step(sched, worker)  # c decodes one by one after the lane, and joins it
    assert plan.seq_ids.tolist() == [0, 1, 2] and plan.start_pos.tolist() == [5, 6, 5]
    assert sched.lane.seq_ids == [0, 1, 2] and sched.lane.steps == 2
    plan, _ = step(sched, worker)
    assert plan.start_pos.tolist() == [6, 7, 6] and sched.lane.steps == 3
    check_consistency(sched, kv, worker)


def test_lane_opens_blocks_and_hashes_the_ones_that_fill():
    sched, kv, worker = make(num_gpu_blocks=32, block_size=4, max_num_seqs=8,
                             max_num_batched_tokens=32, max_model_len=64)
    sched.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=20, ignore_eos=True))
    step(sched, worker)
    step(sched, worker)  # joins the lane; slots 0..5
    tables = []
    for _ in range(6):
        plan, _ = step(sched, worker)
        tables.append((plan.start_pos.tolist(), plan.appended_blocks))
        check_consistency(sched, kv, worker)
    assert sched.lane.steps == 6
    # slot 8 opens block 2 (ids 0 and 1 hold the first 8 slots)
    assert [t[0] for t in tables] == [[6], [7], [8], [9], [10], [11]]
    assert [t[1] for t in tables] == [{}, {}, {0: [2]}, {}, {}, {}]
    seq = sched.queues.seqs[0][1]
    assert kv.num_slots(0) == seq.num_computed == 12
    # all three blocks are full, and each was hashed when its last slot was given out
    # (its token known: a synchronous step): a prompt of those 12 tokens hits them all
    assert kv.lookup_prefix(seq.token_ids[:12] + [0], None) == [0, 1, 2]


def test_lane_outputs_are_the_plain_deltas_and_stops_take_the_general_path():
    sched, kv, worker = make(num_gpu_blocks=32, block_size=4, max_num_seqs=8,
                             max_num_batched_tokens=32, max_model_len=64)
    sched.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5, stop_token_ids=[42]))
    sched.add_request("b", [5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    got = []
    for tokens in ({0: 10, 1: 20}, {0: 11, 1: 21}, {0: 12, 1: 22}, {0: 42, 1: 23}):
        plan = sched.schedule()
        got.append(sched.apply_result(plan, _answer(plan, tokens)))
    assert sched.lane.steps == 2  # the third and fourth steps
    assert got[2] == [RequestOutput("a", [5, 6, 7], [CompletionOutput(0, [12], "")], False),
                      RequestOutput("b", [5, 6], [CompletionOutput(0, [22], "")], False)]
    # a's stop token id and b's length finish both come out of the general path
    assert got[3] == [
        RequestOutput("a", [5, 6, 7], [CompletionOutput(0, [42], "", "stop", 42)], True),
        RequestOutput("b", [5, 6], [CompletionOutput(0, [23], "", "length", None)], True)]
    assert not sched.requests and len(sched.lane.seq_ids) == 2  # evicted, dropped at settle
    plan = sched.schedule()
    assert plan.is_empty and sorted(plan.dropped_seq_ids) == [0, 1] and len(sched.lane) == 0


def test_member_aborted_with_tokens_in_flight_is_dropped_from_both_plans():
    sched, kv, worker = make(num_gpu_blocks=32, block_size=4, max_num_seqs=8,
                             max_num_batched_tokens=32, max_model_len=64)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    sched.add_request("a", [5, 6, 7], sp)
    sched.add_request("b", [8, 9, 10], sp)
    pipe = Pipeline(sched, worker)
    for _ in range(4):
        pipe.step()
    assert sched.lane.steps >= 1 and len(pipe.inflight) == 1
    out = sched.abort("a")  # its token of the plan in flight must be ignored
    assert out.finished and out.outputs[0].finish_reason == "abort"
    outs = pipe.step()
    assert [o.request_id for o in outs] == ["b"]
    check_consistency(sched, kv, worker)
    assert sched.lane.seq_ids == [1]


def test_pending_token_that_ends_a_member_by_length_is_not_computed_ahead():
    sched, kv, worker = make(num_gpu_blocks=32, block_size=4, max_num_seqs=8,
                             max_num_batched_tokens=32, max_model_len=64)
    sched.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add_request("b", [8, 9, 10], SamplingParams(max_tokens=9, ignore_eos=True))
    pipe = Pipeline(sched, worker)
    seen = []
    while pipe.busy():
        for o in pipe.step():
            seen.append((o.request_id, o.outputs[0].token_ids[0], o.outputs[0].finish_reason))
        check_consistency(sched, kv, worker)
    assert [r for r, _, _ in seen].count("a") == 4 and [r for r, _, _ in seen].count("b") == 9
    assert [f for r, _, f in seen if f] == ["length", "length"]
    assert worker.num_pending_filled > 0 and sched.lane.steps > 0


@pytest.mark.parametrize("pipelined", [False, True])
def test_lane_on_and_off_give_the_same_plans_and_outputs(pipelined: bool):
    """Staggered arrivals and lengths with room to spare: every step schedules the same
    sequences at the same positions with the same inputs, and the same blocks, lane or not."""
    runs = []
    for lane in (True, False):
        sched, kv, worker = make(num_gpu_blocks=64, block_size=4, max_num_seqs=8,
                                 max_num_batched_tokens=16, max_model_len=48,
                                 lane_min_running=1 if lane else sys.maxsize)
        plans = []
        execute = worker.execute

        def record(plan, execute=execute, plans=plans):
            rows = zip(plan.seq_ids.tolist(), plan.start_pos.tolist(), plan.query_lens.tolist())
            plans.append(({sid: (pos, qlen) for sid, pos, qlen in rows},
                          sorted(plan.input_ids.tolist()), plan.appended_blocks,
                          sorted(plan.dropped_seq_ids)))
            return execute(plan)

        worker.execute = record
        pipe = Pipeline(sched, worker)
        outputs = []
        for t in range(200):
            if t < 12 and t % 2 == 0:
                sched.add_request(f"r{t}", list(range(2 + t, 9 + 2 * t)),
                                  SamplingParams(max_tokens=6 + t, ignore_eos=True))
            if t >= 12 and not pipe.busy():
                break
            outs = pipe.step() if pipelined else step(sched, worker)[1]
            outputs += [(o.request_id, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                        for o in outs]
            check_consistency(sched, kv, worker)
        runs.append((sorted(outputs), plans, sched.lane.steps))
    assert runs[0][2] > 10 and runs[1][2] == 0
    assert runs[0][1] == runs[1][1]
    assert runs[0][0] == runs[1][0]


def test_lane_forms_with_enough_requests_running_and_empties_below():
    sched, kv, worker = make(num_gpu_blocks=32, block_size=4, max_num_seqs=8,
                             max_num_batched_tokens=32, max_model_len=64, lane_min_running=3)
    sched.add_request("a", [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    sched.add_request("b", [8, 9, 10], SamplingParams(max_tokens=12, ignore_eos=True))
    for _ in range(3):
        step(sched, worker)
    sched.add_request("c", [11, 12, 13], SamplingParams(max_tokens=12, ignore_eos=True))
    step(sched, worker)  # two running when it decodes: one by one; then c is admitted
    assert len(sched.lane) == 0 and sched.lane.steps == 0
    step(sched, worker)  # three running: all three decode one by one and join
    assert sched.lane.seq_ids == [0, 1, 2] and sched.lane.steps == 0
    plan, outs = step(sched, worker)  # the lane's step; a samples its last token
    assert sched.lane.steps == 1 and plan.seq_ids.tolist() == [0, 1, 2]
    assert [o.finished for o in outs] == [True, False, False]
    step(sched, worker)  # two running again: the lane empties
    assert len(sched.lane) == 0 and sched.lane.steps == 1
    assert not any(r.in_lane for r in sched.queues.running)
    sched.add_request("d", [14, 15], SamplingParams(max_tokens=8, ignore_eos=True))
    step(sched, worker)  # two running: one by one; d is admitted
    step(sched, worker)  # three: they join
    assert sched.lane.steps == 1 and sched.lane.seq_ids == [1, 2, 3]
    step(sched, worker)
    assert sched.lane.steps == 2
    check_consistency(sched, kv, worker)


@pytest.mark.parametrize("num_stop_ids", [1, 9])
def test_lane_rows_with_a_stop_token_take_the_general_path(num_stop_ids: int):
    """(9 stop ids: apply_result screens the lane's tokens with np.isin, else one compare
    per id.) A stop token ends its sequence, unless min_tokens holds it back."""
    sched, kv, worker = make(num_gpu_blocks=32, block_size=4, max_num_seqs=8,
                             max_num_batched_tokens=32, max_model_len=64)
    stops = list(range(300, 300 + num_stop_ids))
    sched.add_request("a", [5, 6, 7], SamplingParams(max_tokens=9, stop_token_ids=stops,
                                                     ignore_eos=True))
    sched.add_request("b", [5, 6], SamplingParams(max_tokens=9, stop_token_ids=stops,
                                                  min_tokens=5, ignore_eos=True))
    got = []
    for tokens in ({0: 10, 1: 20}, {0: 11, 1: 21}, {0: 12, 1: stops[-1]},
                   {0: stops[-1], 1: stops[0]}):
        plan = sched.schedule()
        got.append(sched.apply_result(plan, _answer(plan, tokens)))
    assert sched.lane.steps == 2
    assert got[2][1].outputs == [CompletionOutput(0, [stops[-1]], "")]  # min_tokens: kept
    assert got[3] == [
        RequestOutput("a", [5, 6, 7], [CompletionOutput(0, [stops[-1]], "", "stop",
                                                        stops[-1])], True),
        RequestOutput("b", [5, 6], [CompletionOutput(0, [stops[0]], "")], False)]
    sched.check_lane()
    kv.check_invariants()
