"""Prefill/decode disaggregation between two in-process engines (qwen3-tiny, tp 1): the
outputs equal one colocated engine's, the decode side hits its prefix cache on every received
block and on the next turn, a payload that cannot be fetched falls back to computing the
prompt, and no block is held on either side afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from pd_testlib import (
    assert_no_block_held,
    colocated,
    decode,
    disaggregated,
    drain,
    prefill,
    tokens_of,
)

from cluster.engine.config import EngineConfig
from cluster.engine.kv_transport import KVTransferParams
from cluster.engine.llm_engine import LLMEngine
from scheduler import SamplingParams

BLOCK = 16
# 70 tokens: 4 full blocks and 6 tokens of a partial one
PROMPT = [(i * 7919) % 150000 + 100 for i in range(70)]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=50, seed=7, repetition_penalty=1.3,
                   frequency_penalty=0.5, max_tokens=12, ignore_eos=True),
]


def _engine(**kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=8, swap_space=0.01,
                                  block_size=BLOCK, **kw))


@pytest.fixture(scope="module")
def engines(tiny_model_path: str) -> Iterator[tuple[LLMEngine, LLMEngine, LLMEngine]]:
    made = [_engine(kv_role="prefill"), _engine(kv_role="decode", kv_transfer_timeout_s=2.0),
            _engine()]
    yield tuple(made)
    for e in made:
        e.shutdown()


@pytest.fixture(autouse=True)
def _no_leak(engines: tuple[LLMEngine, LLMEngine, LLMEngine]) -> Iterator[None]:
    yield
    for e in engines:
        assert_no_block_held(e)


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded", "seeded-penalties"])
def test_disaggregated_outputs_equal_colocated(engines: tuple, params: SamplingParams) -> None:
    p, d, c = engines
    rid = f"pd-{params.seed}-{params.temperature}"
    salt = [rid.encode().hex()]  # (a fresh prompt per case: no earlier case's cache hit)
    prompt = PROMPT[:-1] + [100 + len(salt[0])]
    want = colocated(c, rid, prompt, params)
    before = d.metrics()
    got = disaggregated(p, d, rid, prompt, params)
    assert got == want and len(got) == 12
    after = d.metrics()
    assert after["kv_transfer_imports_total"] == before["kv_transfer_imports_total"] + 1
    assert after["kv_transfer_fallbacks_total"] == before["kv_transfer_fallbacks_total"]
    # every received block hits: 4 blocks of 16 tokens; only the partial block is computed
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 4 * BLOCK
    assert p.metrics()["kv_transfer_bytes_out_total"] > 0


def test_export_moves_the_prompts_full_blocks_and_counts_bytes(engines: tuple) -> None:
    p, d, _ = engines
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [5000 + i for i in range(3 * BLOCK + 1)]
    before = p.metrics()
    transfer = prefill(p, "bytes", prompt, params)
    mc = p.model_config
    block_bytes = 2 * mc.num_hidden_layers * BLOCK * mc.num_key_value_heads * mc.head_dim * 4
    assert transfer.num_blocks == 3 and transfer.nbytes == 3 * block_bytes
    assert p.metrics()["kv_transfer_bytes_out_total"] - before["kv_transfer_bytes_out_total"] \
        == 3 * block_bytes
    decode(d, "bytes", prompt, params, transfer)  # (the decode side consumes it)
    assert p.metrics()["kv_transfer_seconds"].count >= 1


def test_next_turn_hits_the_decode_sides_prefix_cache(engines: tuple) -> None:
    p, d, c = engines
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt = [7000 + i for i in range(2 * BLOCK + 3)]
    out = disaggregated(p, d, "turn1", prompt, params)
    turn2 = prompt + out + [9000 + i for i in range(5)]
    before = d.metrics()["prefix_cache_hits"]
    d.scheduler.kv.check_invariants()
    got = colocated(d, "turn2", turn2, params)
    assert d.metrics()["prefix_cache_hits"] - before >= 2 * BLOCK
    assert got == colocated(c, "turn2-c", turn2, params)


def test_an_unfetchable_payload_falls_back_to_computing_the_prompt(engines: tuple) -> None:
    p, d, c = engines
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [11000 + i for i in range(3 * BLOCK + 2)]
    want = colocated(c, "lost-c", prompt, params)
    real = prefill(p, "lost", prompt, params)

    class Never:  # a handle whose payload never exists (a Ray ref that is never ready)
        pass

    lost = KVTransferParams([Never()], real.num_blocks, real.block_size,
                            real.tensor_parallel_size, real.first_token, real.nbytes)
    before = d.metrics()
    d.config.kv_transfer_timeout_s = 0.3
    d.kv_transfers.timeout_s = 0.3
    try:
        start = time.monotonic()
        assert decode(d, "lost", prompt, params, lost) == want
        assert time.monotonic() - start < 5.0  # the bound, not a hang
    finally:
        d.kv_transfers.timeout_s = 2.0
    after = d.metrics()
    assert after["kv_transfer_fallbacks_total"] == before["kv_transfer_fallbacks_total"] + 1
    assert after["kv_transfer_imports_total"] == before["kv_transfer_imports_total"]


def test_abort_while_waiting_for_the_payload_leaves_nothing(engines: tuple) -> None:
    p, d, _ = engines
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [13000 + i for i in range(2 * BLOCK + 2)]
    transfer = prefill(p, "abort", prompt, params)
    d.add_request("abort", prompt, params, kv_transfer_params=transfer)
    assert d.has_unfinished()
    d.abort("abort")
    assert not d.has_unfinished() and tokens_of(drain(d), "abort") == []


@pytest.mark.parametrize("field,value,message", [
    ("block_size", 32, "block_size"),
    ("tensor_parallel_size", 2, "tensor_parallel_size"),
])
def test_mismatched_sides_are_refused(engines: tuple, field: str, value: int,
                                      message: str) -> None:
    _, d, _ = engines
    t = KVTransferParams([], 1, BLOCK, 1, 5, 0)
    setattr(t, field, value)
    with pytest.raises(ValueError, match=message):
        d.add_request("mismatch", PROMPT, PARAMS[0], kv_transfer_params=t)
    assert not d.has_unfinished()


def test_roles_are_checked(engines: tuple) -> None:
    p, d, c = engines
    with pytest.raises(ValueError, match="kv_role is None"):
        c.add_request("r1", PROMPT, SamplingParams(max_tokens=1), export_kv=True)
    with pytest.raises(ValueError, match="max_tokens=1"):
        p.add_request("r2", PROMPT, SamplingParams(max_tokens=5), export_kv=True)
    with pytest.raises(ValueError, match="max_tokens >= 2"):
        d.add_request("r3", PROMPT, SamplingParams(max_tokens=1),
                      kv_transfer_params=KVTransferParams([], 1, BLOCK, 1, 5, 0))
    with pytest.raises(ValueError, match="kv_role must be"):
        EngineConfig(kv_role="both")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_role="decode", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_size 0"):
        EngineConfig(kv_role="prefill", kv_offloading_size=0.1)
    with pytest.raises(ValueError, match="set pipeline_parallel_size 1"):
        EngineConfig(kv_role="decode", pipeline_parallel_size=2, executor="ray")
