"""Random arrival / length / abort mixes on a tiny cache: everything ends, token streams equal
an unconstrained run, and no block leaks."""

from __future__ import annotations

import sys

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from scheduler_harness import (
    VOCAB,
    Collected,
    Pipeline,
    check_consistency,
    collect,
    make,
    reference_tokens,
    step,
)

from scheduler import SamplingParams

BS = 4
GPU_BLOCKS = 16
MAX_MODEL_LEN = 40
PREFIXES = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [40, 41, 42, 43, 44, 45, 46, 47]]


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    cfg = {
        "mode": draw(st.sampled_from(["swap", "recompute"])),
        "chunked": draw(st.booleans()),
        "prefix_caching": draw(st.booleans()),
        "watermark": draw(st.sampled_from([0.0, 0.1])),
        "max_num_seqs": draw(st.integers(2, 8)),
        "pipelined": draw(st.booleans()),  # async scheduling: two plans in flight
        # the decode lane at any size; only with 3 requests running or more (it forms and
        # empties as they come and go); off (every decode one by one); or taken even when
        # the KV cache may run short in the step (it then finishes the lane one by one)
        "lane": draw(st.sampled_from(["on", "min3", "off", "always"])),
        # the CPU offload tier for evicted prefix blocks (it needs prefix caching): none, tiny
        # (it evicts too, so some prefixes are gone from both and computed again), roomy
        "offload": draw(st.sampled_from([0, 3, 12])),
    }
    if not cfg["prefix_caching"]:
        cfg["offload"] = 0
    reqs = []
    for i in range(draw(st.integers(2, 10))):
        shared = draw(st.sampled_from([[], *PREFIXES]))
        own = draw(st.lists(st.integers(2, VOCAB - 1), min_size=0 if shared else 4, max_size=16))
        prompt = (shared + own)[:MAX_MODEL_LEN - 2]
        n = draw(st.integers(1, 3))
        max_tokens = draw(st.integers(1, 24))
        # Every request must fit the cache alone (n private copies of its longest sequence);
        # otherwise its stream ends early with "length" and differs from the reference.
        longest = min(len(prompt) + max_tokens, MAX_MODEL_LEN) - 1
        if n * -(-longest // BS) > GPU_BLOCKS:
            n = 1
        sp = SamplingParams(
            n=min(n, cfg["max_num_seqs"]), temperature=0.0, max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, min(3, max_tokens))),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(2, VOCAB - 1), max_size=3)),
        )
        arrival = draw(st.integers(0, 12))
        abort_at = draw(st.one_of(st.none(), st.integers(0, 60)))
        reqs.append((f"r{i}", prompt, sp, arrival, abort_at))
    return {"cfg": cfg, "reqs": reqs}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_mixes_finish_match_reference_and_free_everything(w: dict) -> None:
    cfg = w["cfg"]
    num_cpu = 12 if cfg["mode"] == "swap" else 0
    sched, kv, worker = make(
        num_gpu_blocks=GPU_BLOCKS, num_cpu_blocks=num_cpu, block_size=BS,
        watermark=cfg["watermark"], enable_prefix_caching=cfg["prefix_caching"],
        max_num_seqs=cfg["max_num_seqs"], max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=12 if cfg["chunked"] else MAX_MODEL_LEN,
        enable_chunked_prefill=cfg["chunked"], preemption_mode=cfg["mode"],
        num_offload_blocks=cfg["offload"])
    if cfg["lane"] == "min3":
        sched.lane.min_running = 3
    elif cfg["lane"] == "off":
        sched.lane.min_running = sys.maxsize
    elif cfg["lane"] == "always":
        sched.lane._fits = lambda outside, kv: True
    got: dict[tuple[str, int], Collected] = {}
    finished: set[str] = set()
    aborted: set[str] = set()
    pipe = Pipeline(sched, worker)
    pending = sorted(w["reqs"], key=lambda r: r[3])
    for t in range(2000):
        while pending and pending[0][3] <= t:
            rid, prompt, sp, _, _ = pending.pop(0)
            sched.add_request(rid, prompt, sp)
        for rid, _, _, arrival, abort_at in w["reqs"]:
            if abort_at == t and arrival <= t:
                out = sched.abort(rid)
                if out is not None:
                    aborted.add(rid)
                    assert out.finished and all(c.finish_reason == "abort" for c in out.outputs)
                    collect([out], got, finished)
        if not pending and not pipe.busy():
            break
        outs = pipe.step() if cfg["pipelined"] else step(sched, worker)[1]
        collect(outs, got, finished)
        check_consistency(sched, kv, worker)
    else:
        raise AssertionError(f"still running after 2000 steps: {sched.requests}")

    for rid, prompt, sp, _, _ in w["reqs"]:
        assert rid in finished
        for j in range(sp.n):
            ref = reference_tokens(prompt, sp, j, MAX_MODEL_LEN)
            c = got.get((rid, j), Collected())
            if rid in aborted and c.finish_reason in ("abort", None):
                assert c.token_ids == ref[:len(c.token_ids)], (rid, j)
            else:
                assert c.token_ids == ref, (rid, j)
                assert c.finish_reason in ("stop", "length")
    # No leaks: every block back in its pool, every worker state dropped or about to be.
    kv.check_invariants()
    assert kv.num_free_gpu_blocks == GPU_BLOCKS
    assert kv.num_free_cpu_blocks == num_cpu
    assert set(worker.seqs) == set(sched.queues.drops)
    stats = sched.stats()
    event(f"preempted: swap={stats.preemptions_swap > 0} recompute={stats.preemptions_recompute > 0}")
    event(f"prefix hits: {stats.prefix_hits > 0}")
    kv_stats = kv.stats()
    event(f"offload {cfg['offload']}: offloaded {kv_stats.blocks_offloaded > 0}, loaded back "
          f"{kv_stats.blocks_loaded > 0}")
    assert (worker.num_offloaded, worker.num_loaded) == (kv_stats.blocks_offloaded,
                                                         kv_stats.blocks_loaded)
    event(f"aborted: {bool(aborted)}")
    event(f"lane {cfg['lane']}: lane steps {sched.lane.steps > 0}, cut short "
          f"{sched.lane.steps_cut > 0}")
    event(f"pipelined: {cfg['pipelined']}, pending tokens: {worker.num_pending_filled > 0}, preempted: {stats.preemptions_swap + stats.preemptions_recompute > 0}")
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
    assert not sched.requests and not sched.queues.seqs
