"""Prefill/decode disaggregation's engine half, driven by hand: the prefill engine runs a
request to its first token and exports its prompt's KV, the decode engine imports it and
generates the rest (cluster/engine/kv_transfers.py). Shared by the engine tests."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.kv_transfers import prefill_sampling
from cluster.engine.kv_transport import KVTransferParams
from cluster.engine.llm_engine import LLMEngine
from scheduler import RequestOutput, SamplingParams

# The Ray tests' prompt (3 full blocks of 16 + 5) and their greedy and seeded requests.
RAY_PROMPT = [(i * 104729) % 150000 + 100 for i in range(53)]
RAY_PARAMS = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=77, max_tokens=10,
                             ignore_eos=True)]


def ray_engine(**kw: object) -> LLMEngine:
    """A qwen3-tiny engine as the Ray PD tests make them."""
    return LLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=8, swap_space=0.01, **kw))


def ray_pd_engines(prefill: dict, decode: dict) -> Iterator[tuple]:
    """A module fixture's body: (prefill engine, decode engine with async scheduling, a
    colocated engine), shut down after the module."""
    made = [ray_engine(kv_role="prefill", **prefill),
            ray_engine(kv_role="decode", async_scheduling=True, **decode), ray_engine()]
    yield tuple(made)
    for e in made:
        e.shutdown()


def drain(engine: LLMEngine) -> list[RequestOutput]:
    """Step until nothing is unfinished; every output."""
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def tokens_of(outs: list[RequestOutput], rid: str) -> list[int]:
    return [t for o in outs if o.request_id == rid for t in o.outputs[0].token_ids]


def colocated(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams
              ) -> list[int]:
    engine.add_request(rid, prompt, params)
    return tokens_of(drain(engine), rid)


def prefill(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams
            ) -> KVTransferParams:
    """Run the prefill half; the exported transfer (its first token inside)."""
    engine.add_request(rid, prompt, prefill_sampling(params), export_kv=True)
    last = [o for o in drain(engine) if o.request_id == rid][-1]
    assert last.finished and last.kv_transfer_params is not None
    assert tokens_of([last], rid) == [last.kv_transfer_params.first_token]
    return last.kv_transfer_params


def fresh_export(engines: tuple, tag: str, first: int, params: SamplingParams
                 ) -> tuple[list[int], list[int], dict, KVTransferParams]:
    """A prompt cached on neither side (RAY_PROMPT with its first token `first`): (prompt,
    the colocated engine's output, the decode engine's metrics before, the prefill's export)."""
    p, d, c = engines
    prompt = [first] + RAY_PROMPT[1:]
    want = colocated(c, tag, prompt, params)
    return prompt, want, d.metrics(), prefill(p, tag, prompt, params)


def decode(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
           transfer: KVTransferParams) -> list[int]:
    """Run the decode half; the whole output (the prefill's first token, then the rest)."""
    engine.add_request(rid, prompt, params, kv_transfer_params=transfer)
    return [transfer.first_token] + tokens_of(drain(engine), rid)


def disaggregated(p: LLMEngine, d: LLMEngine, rid: str, prompt: list[int],
                  params: SamplingParams) -> list[int]:
    return decode(d, rid, prompt, params, prefill(p, rid, prompt, params))


def assert_no_block_held(engine: LLMEngine) -> None:
    """The invariant checker passes and every device block is free (cached ones count)."""
    kv = engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_gpu_blocks == kv.num_gpu_blocks


def kill_group(engine: LLMEngine) -> None:
    """Kill every rank of a Ray engine's group and wait until each is gone (ray.kill returns
    before the actor is)."""
    import ray

    for worker in engine.executor.workers:
        ray.kill(worker, no_restart=True)
    for worker in engine.executor.workers:
        with pytest.raises(ray.exceptions.RayActorError):
            for _ in range(300):
                ray.get(worker.ping.remote(), timeout=30)
                time.sleep(0.1)


def assert_imported(before: dict, after: dict, transfer: KVTransferParams) -> None:
    """Between two decode-side `metrics()`: one import of all of `transfer`'s bytes, no
    fallback, and its blocks hit in the prefix cache."""
    assert after["kv_transfer_imports_total"] == before["kv_transfer_imports_total"] + 1
    assert after["kv_transfer_fallbacks_total"] == before["kv_transfer_fallbacks_total"]
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= \
        transfer.num_blocks * transfer.block_size
    assert after["kv_transfer_bytes_in_total"] - before["kv_transfer_bytes_in_total"] \
        == transfer.nbytes > 0
