"""Prefill/decode disaggregation's engine half, driven by hand: the prefill engine runs a
request to its first token and exports its prompt's KV, the decode engine imports it and
generates the rest (cluster/engine/kv_transfers.py). Shared by the engine tests."""

from __future__ import annotations

from cluster.engine.kv_transfers import prefill_sampling
from cluster.engine.kv_transport import KVTransferParams
from cluster.engine.llm_engine import LLMEngine
from scheduler import RequestOutput, SamplingParams


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
