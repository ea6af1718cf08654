"""Which adapters share a step (scheduler/lora.py): slots, pins, LRU eviction, and a request
whose adapter finds no slot waiting at the head of the queue, never starved."""

from __future__ import annotations

import pytest
from scheduler_harness import check_consistency, make, run_to_completion, step

from scheduler import SamplingParams
from scheduler.lora import LoRARequest, LoRASlots


def _lora(i: int) -> LoRARequest:
    return LoRARequest(f"adapter-{i}", i, f"/adapters/{i}")


def test_slots_evict_the_least_recently_released_unused_adapter() -> None:
    slots = LoRASlots(2)
    assert slots.place(1) == 0 and slots.place(2) == 1
    assert [(load.slot, load.lora_id) for load in slots.take_loads()] == [(0, 1), (1, 2)]
    slots.pin(1)
    slots.pin(2)
    assert not slots.can_place(3)  # both pinned by running requests
    slots.unpin(2)
    slots.pin(1)
    slots.unpin(1)  # 1 still has a user
    assert slots.can_place(3) and slots.place(3) == 1  # 2 evicted, its slot reused
    assert [(load.slot, load.lora_id) for load in slots.take_loads()] == [(1, 3)]
    slots.unpin(1)
    slots.check()
    assert list(slots.lru) == [3, 1]
    assert slots.place(4) == 1  # 3 (placed, never pinned) is the older unused one
    slots.check()


def test_a_load_evicted_in_the_same_step_is_not_sent() -> None:
    slots = LoRASlots(1)
    slots.place(1)  # placed for a request that then could not be scheduled
    slots.place(2)
    assert [(load.slot, load.lora_id) for load in slots.take_loads()] == [(0, 2)]


@pytest.mark.parametrize("pipelined", [False, True])
def test_another_adapter_waits_at_the_head_and_runs_before_later_requests(
        pipelined: bool) -> None:
    core, kv, worker = make(num_gpu_blocks=64, block_size=4, max_num_seqs=8,
                            max_num_batched_tokens=64, max_loras=1)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    order = [1, 2, 1, 0, 1]  # adapter of each request (0: the base model)
    for i, lora in enumerate(order):
        core.add_request(f"r{i}", [10 + i, 11, 12, 13, 14], sp,
                         lora_request=_lora(lora) if lora else None)
    plans = []
    schedule = core.sched.schedule

    def recording():
        plans.append(schedule())
        return plans[-1]

    core.sched.schedule = recording
    got = run_to_completion(core, kv, worker, pipelined=pipelined)
    assert len(got) == len(order)
    first_step: dict[str, int] = {}
    slot_of: dict[int, int] = {}
    for k, plan in enumerate(plans):
        for new in plan.new_seqs:
            first_step.setdefault(new.request_id, k)
            slot_of[new.seq_id] = new.lora_slot
        assert {slot_of[int(s)] for s in plan.seq_ids} <= {-1, 0}  # one slot: one adapter
    # r1 (adapter 2) waited for r0's slot; r2 (adapter 1, resident) did not pass it
    assert first_step["r0"] < first_step["r1"] <= first_step["r2"] <= first_step["r3"]
    loads = [(load.slot, load.lora_id) for plan in plans for load in plan.lora_loads]
    assert loads == [(0, 1), (0, 2), (0, 1)]
    core.sched.lora.check()
    assert not any(core.sched.lora.users.values())


def test_preempted_requests_release_their_adapter_and_get_it_back() -> None:
    core, kv, worker = make(num_gpu_blocks=10, block_size=4, max_num_seqs=4,
                            max_num_batched_tokens=32, max_loras=2)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(4):
        core.add_request(f"r{i}", [20 + i] * 6, sp, lora_request=_lora(1 + i % 2))
    for _ in range(200):
        if not core.has_unfinished():
            break
        step(core, worker)
        check_consistency(core, kv, worker)
        lora = core.sched.lora
        lora.check()
        running = [r.lora_id for r in core.queues.running]
        assert {i: running.count(i) for i in set(running)} == \
            {i: n for i, n in lora.users.items() if n}
    assert not core.has_unfinished()
    assert core.stats().preemptions_recompute > 0


def test_a_lora_request_with_lora_off_is_refused() -> None:
    core, _, _ = make()
    with pytest.raises(ValueError, match="LoRA is off"):
        core.add_request("r", [1, 2, 3], SamplingParams(), lora_request=_lora(1))


def test_an_adapter_reloaded_under_a_name_another_had_hashes_apart() -> None:
    core, _, _ = make(max_loras=2)
    old, new = LoRARequest("sql", 1, "/adapters/v1"), LoRARequest("sql", 2, "/adapters/v2")
    prompt = list(range(1, 17))
    for rid, lora in (("a", old), ("b", new), ("c", LoRARequest("sql", 1, "/adapters/v1"))):
        core.add_request(rid, prompt, SamplingParams(max_tokens=1), lora_request=lora)
    hashes = {rid: core.requests[rid].block_hashes for rid in "abc"}
    assert hashes["a"] != hashes["b"] and hashes["a"] == hashes["c"]
    assert old.cache_key != new.cache_key
