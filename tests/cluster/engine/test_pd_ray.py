"""Prefill/decode disaggregation between two tp 2 engines on Ray (qwen3-tiny): each rank
exports its own shard of the KV heads into the object store and the decode side's rank of the
same index pulls it; the outputs equal one colocated engine's; a prefill group that dies
before the pull leaves the decode side to compute the prompt (the payloads' owner is gone).
The decode side schedules asynchronously (a lagged compiled graph), so its imports wait for
no plan to be in flight."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from pd_testlib import (
    RAY_PARAMS,
    RAY_PROMPT,
    assert_imported,
    assert_no_block_held,
    colocated,
    decode,
    disaggregated,
    fresh_export,
    kill_group,
    prefill,
    ray_pd_engines,
)

from scheduler import SamplingParams

PROMPT, PARAMS = RAY_PROMPT, RAY_PARAMS


@pytest.fixture(scope="module")
def engines(ray_cluster: None, tiny_model_path: str) -> Iterator[tuple]:
    tp2 = dict(tensor_parallel_size=2, worker_num_cpus=0.5)
    yield from ray_pd_engines(tp2, dict(kv_transfer_timeout_s=5.0, **tp2))


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_tp2_to_tp2_outputs_equal_colocated(engines: tuple, params: SamplingParams) -> None:
    p, d, _ = engines
    rid = f"ray-{params.temperature}"
    prompt, want, before, transfer = fresh_export(engines, rid, int(params.temperature) + 100,
                                                  params)
    assert len(transfer.payloads) == 2 and transfer.num_blocks == 3
    assert decode(d, rid, prompt, params, transfer) == want
    assert_imported(before, d.metrics(), transfer)
    for e in (p, d):
        assert_no_block_held(e)


@pytest.mark.parametrize("how", ["failed", "never-ready"])
def test_an_unfetchable_payload_falls_back_to_computing_the_prompt(engines: tuple,
                                                                  how: str) -> None:
    """Each decode rank's fetch fails (the object's task failed: what a lost object gives), or
    the payloads never exist (the bound passes): the decode side computes the prompt."""
    import ray

    @ray.remote(num_cpus=0.01)
    def failed() -> None:
        raise RuntimeError("payload lost")

    @ray.remote(num_cpus=0.01)
    def never_ready() -> None:
        time.sleep(120)

    p, d, c = engines
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [200 + len(how)] + PROMPT[1:40]
    want = colocated(c, f"lost-{how}", prompt, params)
    transfer = prefill(p, f"lost-{how}", prompt, params)
    task = failed if how == "failed" else never_ready
    transfer.payloads = [task.remote() for _ in transfer.payloads]
    before = d.metrics()
    start = time.monotonic()
    assert decode(d, f"lost-{how}", prompt, params, transfer) == want
    assert time.monotonic() - start < 30  # the 5 s bound, not a hang
    after = d.metrics()
    assert after["kv_transfer_fallbacks_total"] == before["kv_transfer_fallbacks_total"] + 1
    assert after["kv_transfer_imports_total"] == before["kv_transfer_imports_total"]
    assert_no_block_held(d)
    for ref in transfer.payloads:
        ray.cancel(ref, force=True)


def test_prefill_group_killed_after_the_export_loses_nothing(engines: tuple) -> None:
    """Its ranks owned the payloads. Ray may still serve a dead threaded actor's object from
    the node's store (seen here), which is the right KV; else the decode side computes the
    prompt. Either way the output is the colocated one, and the prefill engine rebuilds its
    group and serves again."""

    p, d, c = engines
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [300] + PROMPT[1:45]
    want = colocated(c, "dead", prompt, params)
    transfer = prefill(p, "dead", prompt, params)
    kill_group(p)
    before = d.metrics()
    assert decode(d, "dead", prompt, params, transfer) == want
    after = d.metrics()
    moved = sum(after[k] - before[k] for k in ("kv_transfer_fallbacks_total",
                                                "kv_transfer_imports_total"))
    assert moved == 1
    assert_no_block_held(d)
    assert disaggregated(p, d, "after", [301] + prompt[1:], params) == \
        colocated(c, "after-c", [301] + prompt[1:], params)
    assert_no_block_held(p)

