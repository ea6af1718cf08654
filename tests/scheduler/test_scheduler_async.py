"""Async scheduling: plan N+1 is built before plan N's result is applied (block size 4)."""

from __future__ import annotations

import pytest
from scheduler_harness import (
    Collected,
    FakeWorker,
    Pipeline,
    check_consistency,
    collect,
    make,
    next_token,
    reference_tokens,
    run_to_completion,
)
from test_scheduler_plans import summary

from kvcache import KVCacheManager, prompt_block_hashes
from scheduler import SamplingParams
from scheduler.plan import PENDING_TOKEN

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_decode_scheduled_ahead_carries_the_pending_token() -> None:
    sched, kv, worker = make()
    prompt = [5, 6, 7]
    sched.add_request("a", prompt, SamplingParams(max_tokens=4, **GREEDY))
    first = sched.schedule()
    second = sched.schedule()
    assert summary(first) == {"seqs": [0], "q": [3], "start": [0], "ids": prompt,
                              "sample": [True], "new": [(0, 0, 3, [], [0])]}
    # The token the first plan samples, computed at position 3 before the scheduler knows it;
    # position 3 fills block 0, the next position opens block 1 in the plan after.
    assert summary(second) == {"seqs": [0], "q": [1], "start": [3], "ids": [PENDING_TOKEN],
                               "sample": [True]}
    r1, r2 = worker.execute(first), worker.execute(second)
    t0 = next_token(prompt, 0)
    assert worker.seqs[0].history == prompt + [t0]
    out1 = sched.apply_result(first, r1)
    assert out1[0].outputs[0].token_ids == [t0]
    third = sched.schedule()  # after the first's result, with the second's still to come
    assert summary(third) == {"seqs": [0], "q": [1], "start": [4], "ids": [PENDING_TOKEN],
                              "sample": [True], "append": {0: [1]}}
    worker.execute(third)
    out2 = sched.apply_result(second, r2)
    assert out2[0].outputs[0].token_ids == [next_token(prompt + [t0], 0)]
    check_consistency(sched, kv, worker)


def test_block_filled_ahead_of_its_token_is_cached_once_the_token_is_known() -> None:
    sched, kv, worker = make()
    prompt = [5, 6, 7]
    sched.add_request("a", prompt, SamplingParams(max_tokens=4, **GREEDY))
    pipe = Pipeline(sched, worker)
    pipe.step()  # plan 1 applied; plan 2 (position 3, pending) in flight
    assert kv.num_slots(0) == 4 and kv.gpu_pool.blocks[0].block_hash is None
    kv.check_invariants()  # the last full block may lag one behind
    pipe.step()  # plan 3 opens block 1 and hashes block 0, whose last token is now known
    t0 = next_token(prompt, 0)
    assert kv.gpu_pool.blocks[0].block_hash == prompt_block_hashes(prompt + [t0], 4, None)[0]
    kv.check_invariants()


def test_pending_token_that_ends_the_sequence_by_length_is_not_computed_ahead() -> None:
    sched, kv, worker = make()
    sched.add_request("a", [5, 6, 7], SamplingParams(max_tokens=1, **GREEDY))
    first = sched.schedule()
    second = sched.schedule()
    assert second.is_noop  # nothing for the workers
    sched.apply_result(first, worker.execute(first))
    sched.apply_result(second, None)
    assert not sched.has_unfinished() and kv.num_free_gpu_blocks == 16


def test_stop_token_in_flight_costs_one_wasted_decode_and_nothing_else() -> None:
    prompt = [3, 4, 5]
    free_run = reference_tokens(prompt, SamplingParams(max_tokens=8, **GREEDY), 0, 4096)
    stop = free_run[2]
    assert stop not in free_run[:2]
    sp = SamplingParams(max_tokens=8, stop_token_ids=[stop], **GREEDY)
    sched, kv, worker = make()
    sched.add_request("a", prompt, sp)
    got = run_to_completion(sched, kv, worker, pipelined=True)
    assert got[("a", 0)].token_ids == free_run[:3] == reference_tokens(prompt, sp, 0, 4096)
    assert got[("a", 0)].finish_reason == "stop"
    assert worker.num_sampled == 4  # the step after the stop token computed it in vain
    assert kv.num_free_gpu_blocks == 16
    plan = sched.schedule()  # the finished sequence's state goes in the next plan
    assert summary(plan) == {"drop": [0]}


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_sequence_keeps_the_token_it_had_in_flight(mode: str) -> None:
    kw = {"num_cpu_blocks": 8} if mode == "swap" else {}
    sched, kv, worker = make(num_gpu_blocks=4, max_num_batched_tokens=8, max_num_seqs=2,
                             preemption_mode=mode, **kw)
    prompts = {"a": [5, 6, 7], "b": [200, 201, 202, 203, 204]}
    sp = SamplingParams(max_tokens=6, **GREEDY)
    for rid, prompt in prompts.items():
        sched.add_request(rid, prompt, sp)
    got = run_to_completion(sched, kv, worker, pipelined=True)
    for rid, prompt in prompts.items():
        assert got[(rid, 0)].token_ids == reference_tokens(prompt, sp, 0, 4096)
    stats = sched.stats()
    assert (stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute) > 0
    assert worker.num_pending_filled > 0
    assert kv.num_free_gpu_blocks == 4 and kv.num_free_cpu_blocks == kw.get("num_cpu_blocks", 0)


def test_request_alone_that_outgrows_the_cache_waits_for_its_token_in_flight() -> None:
    """The cache-capacity finish is decided with the token in flight landed: the same
    stream as without async scheduling."""
    sp = SamplingParams(max_tokens=20, **GREEDY)
    streams = []
    for pipelined in (False, True):
        sched, kv, worker = make(num_gpu_blocks=2, max_num_batched_tokens=8, max_num_seqs=2)
        sched.add_request("a", [5, 6, 7], sp)
        got = run_to_completion(sched, kv, worker, pipelined=pipelined)
        streams.append((got[("a", 0)].token_ids, got[("a", 0)].finish_reason))
        assert kv.num_free_gpu_blocks == 2
    assert streams[0] == streams[1]
    assert streams[1] == (reference_tokens([5, 6, 7], SamplingParams(max_tokens=6, **GREEDY),
                                           0, 4096), "length")


def test_n2_fork_and_stop_with_tokens_in_flight() -> None:
    prompt = [3, 4, 5]
    free_run = SamplingParams(n=2, max_tokens=6, **GREEDY)
    out0, out1 = (reference_tokens(prompt, free_run, i, 4096) for i in (0, 1))
    stop = out1[1]
    assert stop not in out0
    sp = SamplingParams(n=2, max_tokens=6, stop_token_ids=[stop], **GREEDY)
    sched, kv, worker = make(num_gpu_blocks=8, max_num_batched_tokens=8, max_num_seqs=4)
    sched.add_request("a", prompt, sp)
    got = run_to_completion(sched, kv, worker, pipelined=True)
    assert got[("a", 0)].token_ids == out0 and got[("a", 1)].token_ids == out1[:2]
    assert got[("a", 1)].finish_reason == "stop"
    assert kv.num_free_gpu_blocks == 8


def test_manager_reserves_a_slot_ahead_and_refuses_two() -> None:
    kv = KVCacheManager(8, 0, 4, enable_prefix_caching=True)
    tokens = [1, 2, 3]
    kv.allocate_slots(0, tokens, 3)
    kv.allocate_slots(0, tokens, 1, num_pending=1)
    assert kv.num_slots(0) == 4
    with pytest.raises(ValueError, match="1 pending"):
        kv.allocate_slots(0, tokens, 1, num_pending=1)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_reset_for_recompute_after_losing_the_workers_gives_the_same_streams(mode: str) -> None:
    """The workers lose every sequence mid-run (plans in flight, some requests preempted):
    reset_for_recompute puts every unfinished request back to recompute, and the streams go
    on to exactly the reference tokens, with nothing leaked."""
    kw = {"num_cpu_blocks": 8} if mode == "swap" else {}
    sched, kv, worker = make(num_gpu_blocks=6, max_num_batched_tokens=8, max_num_seqs=4,
                             preemption_mode=mode, **kw)
    prompts = {"a": [5, 6, 7], "b": [200, 201, 202, 203, 204], "c": [9, 8, 7, 6]}
    sps = {"a": SamplingParams(max_tokens=9, **GREEDY), "b": SamplingParams(max_tokens=7, **GREEDY),
           "c": SamplingParams(n=2, max_tokens=5, **GREEDY)}
    for rid, prompt in prompts.items():
        sched.add_request(rid, prompt, sps[rid])
    got: dict = {}
    finished: set[str] = set()
    pipe = Pipeline(sched, worker)
    for _ in range(6):
        collect(pipe.step(), got, finished)
    assert pipe.inflight and sched.has_unfinished()
    s = sched.stats()  # one request preempted (swapped, or waiting to recompute), two running
    assert (s.num_running, s.num_swapped + s.num_waiting) == (2, 1)
    assert s.preemptions_swap + s.preemptions_recompute == 1
    sched.reset_for_recompute()  # the plans in flight never answer
    assert kv.num_free_gpu_blocks == 6 and not sched.queues.running and not sched.queues.drops
    worker = FakeWorker(6, kw.get("num_cpu_blocks", 0), 4)
    got_after = run_to_completion(sched, kv, worker, pipelined=True)
    for key, c in got_after.items():
        g = got.setdefault(key, Collected())
        g.token_ids += c.token_ids
        g.finish_reason = c.finish_reason
    for rid, prompt in prompts.items():
        for i in range(sps[rid].n):
            assert got[(rid, i)].token_ids == reference_tokens(prompt, sps[rid], i, 4096)
            assert got[(rid, i)].finish_reason == "length"
    assert kv.num_free_gpu_blocks == 6 and kv.num_free_cpu_blocks == kw.get("num_cpu_blocks", 0)
