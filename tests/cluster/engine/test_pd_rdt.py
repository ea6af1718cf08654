"""Prefill/decode disaggregation over Ray Direct Transport (`kv_transport: rdt`) on CPU: gloo
pairs between a tp 1 prefill engine's rank and a tp 1 decode engine's rank (Ray executor);
the outputs equal one colocated engine's; a prefill group killed after its export leaves the
decode side to compute the prompt, and once the prefill engine rebuilds, the decode side
pairs with its new rank. tp 2 over gloo is refused (Ray's gloo group takes the rank's default
torch.distributed world, which tensor parallelism holds): that refusal is tested here, tp 2
moves through the object store (test_pd_ray.py). The same over NCCL: test_pd_rdt_gpu.py."""

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
    drain,
    fresh_export,
    kill_group,
    prefill,
    ray_pd_engines,
    tokens_of,
)

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.rdt_transport import RDTHandle
from scheduler import SamplingParams

PROMPT, PARAMS = RAY_PROMPT, RAY_PARAMS
RDT = dict(executor="ray", kv_transport="rdt", worker_num_cpus=0.25)


@pytest.fixture(scope="module")
def engines(ray_cluster: None, tiny_model_path: str) -> Iterator[tuple]:
    both = dict(kv_transfer_timeout_s=30.0, **RDT)
    yield from ray_pd_engines(both, both)


def _held(p: LLMEngine, transfer: object) -> list[bool]:
    import ray

    return ray.get([h.actor.has_kv.remote(h.key) for h in transfer.payloads])


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_rdt_gloo_outputs_equal_colocated(engines: tuple, params: SamplingParams) -> None:
    p, d, _ = engines
    rid = f"rdt-{params.temperature}"
    prompt, want, before, transfer = fresh_export(engines, rid, int(params.temperature) + 400,
                                                  params)
    assert transfer.num_blocks == 3 and len(transfer.payloads) == 1
    assert all(isinstance(h, RDTHandle) and h.backend == "gloo" for h in transfer.payloads)
    assert _held(p, transfer) == [True]  # on the prefill rank, its blocks already free
    assert_no_block_held(p)
    assert decode(d, rid, prompt, params, transfer) == want
    assert_imported(before, d.metrics(), transfer)
    assert _held(p, transfer) == [False]  # taken once: the prefill rank keeps nothing
    assert_no_block_held(d)


def test_a_payload_pulled_twice_falls_back_the_second_time(engines: tuple) -> None:
    """The same handles again (a retried request): the prefill rank handed the payload over
    already, so the decode side computes the prompt, within the bound."""
    p, d, c = engines
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [500] + PROMPT[1:40]
    want = colocated(c, "twice", prompt, params)
    transfer = prefill(p, "twice", prompt, params)
    assert decode(d, "twice-1", prompt, params, transfer) == want
    before = d.metrics()
    start = time.monotonic()
    # (another cache salt: else the first pull's blocks are a prefix hit and nothing is pulled)
    d.add_request("twice-2", prompt, params, cache_salt="again", kv_transfer_params=transfer)
    assert [transfer.first_token] + tokens_of(drain(d), "twice-2") == want
    assert time.monotonic() - start < 20
    after = d.metrics()
    assert after["kv_transfer_fallbacks_total"] == before["kv_transfer_fallbacks_total"] + 1
    assert after["kv_transfer_imports_total"] == before["kv_transfer_imports_total"]
    assert_no_block_held(d)


def test_prefill_group_killed_after_the_export_loses_nothing(engines: tuple) -> None:
    """The payload lived on the killed rank: the decode side computes the prompt (0 lost, no
    hang, no block held); the prefill engine rebuilds its rank, and the decode side leaves
    its pair with the dead one and pairs with the new one."""

    p, d, c = engines
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [600] + PROMPT[1:45]
    want = colocated(c, "dead", prompt, params)
    transfer = prefill(p, "dead", prompt, params)
    kill_group(p)
    before = d.metrics()
    start = time.monotonic()
    assert decode(d, "dead", prompt, params, transfer) == want
    assert time.monotonic() - start < 40
    after = d.metrics()
    assert after["kv_transfer_fallbacks_total"] == before["kv_transfer_fallbacks_total"] + 1
    assert after["kv_transfer_imports_total"] == before["kv_transfer_imports_total"]
    assert_no_block_held(d)
    again = [601] + prompt[1:]
    before = d.metrics()
    assert disaggregated(p, d, "after", again, params) == colocated(c, "after-c", again, params)
    assert d.metrics()["kv_transfer_imports_total"] == before["kv_transfer_imports_total"] + 1
    assert_no_block_held(p)
    assert_no_block_held(d)

