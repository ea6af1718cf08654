"""Micro-batches (SchedulerConfig.micro_batches, pipeline parallelism): up to that many plans in
flight, disjoint in the sequences they sample, never a PENDING_TOKEN; the tokens are the
reference's, with chunked prefill, n > 1 and preemption (block size 4)."""

from __future__ import annotations

import math

import pytest
from scheduler_harness import check_consistency, make, reference_tokens, run_to_completion

from scheduler import SamplingParams, SchedulerConfig
from scheduler.plan import PENDING_TOKEN, StepPlan

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _prompts(k: int) -> dict[str, list[int]]:
    return {f"r{i}": [100 + 7 * i + j for j in range(3 + i % 5)] for i in range(k)}


def _sampled(plan: StepPlan) -> set[int]:
    return set(plan.seq_ids[plan.do_sample].tolist())


def test_plans_in_flight_are_disjoint_and_share_the_sequences() -> None:
    sched, kv, worker = make(num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                             micro_batches=2)
    prompts = _prompts(8)
    sp = SamplingParams(max_tokens=5, **GREEDY)
    for rid, p in prompts.items():
        sched.add_request(rid, p, sp)
    inflight: list[tuple[StepPlan, object]] = []
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    both_busy = 0
    while sched.has_unfinished() or inflight:
        while len(inflight) < 2 and sched.has_unfinished():
            plan = sched.schedule()
            assert PENDING_TOKEN not in plan.input_ids.tolist()
            assert plan.num_seqs <= math.ceil(8 / 2)  # half of max_num_seqs each
            for other, _ in inflight:
                assert not _sampled(plan) & _sampled(other), "a sequence sampled twice in flight"
            inflight.append((plan, worker.execute(plan)))
        both_busy += sum(not p.is_noop for p, _ in inflight) == 2
        plan, result = inflight.pop(0)
        for out in sched.apply_result(plan, result):
            got[out.request_id] += out.outputs[0].token_ids
        check_consistency(sched, kv, worker)
    with pytest.raises(RuntimeError, match="at most 2 plans"):
        sched.schedule(), sched.schedule(), sched.schedule()
    assert both_busy >= 4
    assert worker.num_pending_filled == 0
    for rid, p in prompts.items():
        assert got[rid] == reference_tokens(p, sp, 0, 4096)


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_chunked_prefill_n2_and_recompute_preemption_give_the_reference_tokens(
        micro_batches: int) -> None:
    # 12 blocks of 4 cannot hold six sequences growing to 4 blocks each: preemption.
    sched, kv, worker = make(num_gpu_blocks=12, max_num_seqs=6, max_num_batched_tokens=8,
                             preemption_mode="recompute", micro_batches=micro_batches)
    prompts = _prompts(5)
    sps = {rid: SamplingParams(n=2 if rid == "r1" else 1, max_tokens=8, **GREEDY)
           for rid in prompts}
    for rid, p in prompts.items():
        sched.add_request(rid, p, sps[rid])
    got = run_to_completion(sched, kv, worker, pipelined=True, depth=micro_batches)
    for rid, p in prompts.items():
        for i in range(sps[rid].n):
            assert got[(rid, i)].token_ids == reference_tokens(p, sps[rid], i, 4096)
    assert sched.stats().preemptions_recompute > 0
    assert worker.num_pending_filled == 0
    assert kv.num_free_gpu_blocks == 12


def test_one_micro_batch_is_async_scheduling_and_zero_is_refused() -> None:
    sched, _, _ = make()
    assert sched.inflight.limit == 2 and not sched.inflight.disjoint
    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1"):
        SchedulerConfig(micro_batches=0)
    assert sched.inflight.seq_slots(8, sched.queues) == 8


def test_a_lone_n3_request_forks_though_its_share_is_smaller() -> None:
    """One request of n = 3 at micro_batches 2: its fork needs 3 sequence slots in one plan,
    more than half of 3; the plan's share is raised to it (else it would never fork)."""
    sched, kv, worker = make(num_gpu_blocks=32, max_num_seqs=8, micro_batches=2)
    sp = SamplingParams(n=3, max_tokens=4, **GREEDY)
    sched.add_request("a", [5, 6, 7, 8, 9], sp)
    got = run_to_completion(sched, kv, worker, pipelined=True, depth=2)
    for i in range(3):
        assert got[("a", i)].token_ids == reference_tokens([5, 6, 7, 8, 9], sp, i, 4096)
    assert kv.num_free_gpu_blocks == 32
