"""The CPU offload tier behind the scheduler, with the fake model (scheduler_harness): a prefix
the GPU evicted is loaded back instead of recomputed, and every token stream equals the
unlimited-memory reference and the run without the tier (the fake worker reads each context
back from its KV, so a wrong load, a load too late or an offload too late changes tokens)."""

from __future__ import annotations

import random

import pytest
from scheduler_harness import make, reference_tokens, run_to_completion, step

from scheduler import SamplingParams

BS = 4
MAX_MODEL_LEN = 96


def _conversations(num: int, turns: int, seed: int) -> list[list[list[int]]]:
    """Per conversation, each turn's new user tokens; turn 0 starts with its system prompt."""
    rng = random.Random(seed)
    return [[[rng.randrange(2, 499) for _ in range(16 if t == 0 else 6)] for t in range(turns)]
            for _ in range(num)]


def _multi_turn(offload: int, *, mode: str = "recompute", pipelined: bool = False, n: int = 1,
                chunk: int | None = None, gpu: int = 14, seed: int = 0):
    """Every conversation's turn t is asked once turn t - 1 of all of them has finished; its
    prompt is the conversation so far (prompts, and the first sample's answers)."""
    sched, kv, worker = make(
        num_gpu_blocks=gpu, num_cpu_blocks=24 if mode == "swap" else 0, block_size=BS,
        num_offload_blocks=offload, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
        max_num_batched_tokens=chunk or MAX_MODEL_LEN, enable_chunked_prefill=chunk is not None,
        preemption_mode=mode)
    convs = _conversations(3, 4, seed)
    history = [[] for _ in convs]
    streams: dict[tuple[str, int], list[int]] = {}
    for t in range(4):
        for c, turns in enumerate(convs):
            history[c] += turns[t]
            sp = SamplingParams(n=n if t == 2 else 1, temperature=0, max_tokens=5, ignore_eos=True)
            sched.add_request(f"c{c}t{t}", list(history[c]), sp)
        got = run_to_completion(sched, kv, worker, pipelined=pipelined)
        for c in range(len(convs)):
            for (rid, j), col in got.items():
                if rid == f"c{c}t{t}":
                    streams[(rid, j)] = col.token_ids
                    ref = reference_tokens(history[c], SamplingParams(temperature=0, max_tokens=5,
                                                                      ignore_eos=True), j,
                                           MAX_MODEL_LEN)
                    assert col.token_ids == ref, (rid, j)
            history[c] += streams[(f"c{c}t{t}", 0)]
    kv.check_invariants()
    s = kv.stats()
    assert s.num_free_gpu_blocks == s.num_gpu_blocks
    assert not worker.seqs.keys() - set(sched.queues.drops)
    assert (worker.num_offloaded, worker.num_loaded) == (s.blocks_offloaded, s.blocks_loaded)
    return streams, s, sched.stats()


@pytest.mark.parametrize(("mode", "pipelined"), [("recompute", False), ("swap", False),
                                                 ("recompute", True), ("swap", True)])
def test_evicted_prefixes_load_back_and_streams_match_the_tier_off(mode: str, pipelined: bool) -> None:
    off, off_stats, _ = _multi_turn(0, mode=mode, pipelined=pipelined)
    on, on_stats, sched_stats = _multi_turn(32, mode=mode, pipelined=pipelined)
    assert on == off
    assert on_stats.blocks_offloaded > 0 and on_stats.blocks_loaded > 0
    assert on_stats.external_prefix_hits == on_stats.blocks_loaded * BS
    assert 0 < on_stats.external_prefix_hits <= on_stats.external_prefix_queries
    # what the tier served was computed without it
    assert on_stats.prefix_hits + on_stats.external_prefix_hits > off_stats.prefix_hits
    assert sched_stats.external_prefix_hits == on_stats.external_prefix_hits
    # the tiny pool also preempts, in the mode asked
    assert (sched_stats.preemptions_swap if mode == "swap" else sched_stats.preemptions_recompute) > 0


def test_tier_with_parallel_sampling_and_a_chunked_prefill_after_the_loaded_prefix() -> None:
    off, _, _ = _multi_turn(0, n=3, chunk=8)
    on, s, _ = _multi_turn(32, n=3, chunk=8)
    assert on == off and len([k for k in on if k[1] == 2]) == 3  # the n = 3 turn, every conv
    assert s.blocks_loaded > 0


def test_a_prefix_gone_from_both_tiers_is_recomputed() -> None:
    """A two-block tier keeps only the latest evictions: earlier prefixes are in neither."""
    off, _, _ = _multi_turn(0, seed=3)
    on, s, _ = _multi_turn(2, seed=3)
    assert on == off
    assert s.blocks_offloaded > s.num_offload_blocks  # the tier evicted too
    assert s.external_prefix_hits < s.external_prefix_queries


def test_loaded_blocks_are_in_the_plan_of_the_step_that_reads_them() -> None:
    sched, kv, worker = make(num_gpu_blocks=6, block_size=BS, num_offload_blocks=8,
                             max_model_len=32, max_num_batched_tokens=32, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    system = list(range(10, 22))  # three full blocks
    sched.add_request("a", system + [5], sp)
    plan, _ = step(sched, worker)
    a_blocks = plan.new_seqs[0].block_table
    run_to_completion(sched, kv, worker)
    sched.add_request("b", list(range(100, 120)), sp)  # five blocks: evicts two of a's
    plan, _ = step(sched, worker)
    # LRU: a's blocks were freed last block first, so its first block stays on the GPU
    assert plan.offload.tolist() == [[a_blocks[2], 0], [a_blocks[1], 1]]
    assert len(plan.load) == 0
    run_to_completion(sched, kv, worker)
    sched.add_request("c", system + [7, 8], sp)
    plan, outs = step(sched, worker)
    table = plan.new_seqs[0].block_table
    assert table[0] == a_blocks[0]  # the GPU hit, then two blocks loaded from the tier
    assert plan.load.tolist() == [[1, table[1]], [0, table[2]]]  # (a_blocks[1] went to 1)
    assert plan.start_pos.tolist() == [12] and plan.input_ids.tolist() == [7, 8]
    assert plan.new_seqs[0].computed_token_ids == system
    assert outs[0].outputs[0].token_ids == reference_tokens(system + [7, 8], sp, 0, 32)
    assert outs[0].num_cached_tokens == 12
    s = kv.stats()
    assert (s.prefix_hits, s.external_prefix_queries, s.external_prefix_hits) == (4, 13 + 20 + 10, 8)
