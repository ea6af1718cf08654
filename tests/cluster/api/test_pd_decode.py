"""A decode replica's half of the PD handshake (cluster/api/pd_app.py `decode_after_prefill`),
over real qwen3-tiny engines in this process: the decode replica calls the prefill role
itself, so the KV payloads go from the prefill engine to the decode engine without passing
through the ingress's stream, and the stream it yields is the prefill's first token, then the
decode engine's tokens, equal to a colocated engine's. A lost prefill replica leaves the whole
request to the decode side; a first token that ends the request is the whole stream."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.api.pd_app import PDEngineClient, decode_after_prefill
from cluster.engine.async_llm_engine import AsyncLLMEngine
from cluster.engine.config import EngineConfig
from scheduler import RequestOutput, SamplingParams
from scheduler.lora import LoRARequest

PROMPT = [(i * 104729) % 150000 + 100 for i in range(53)]  # 3 full blocks of 16, then 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=77, max_tokens=8, ignore_eos=True)


class EnginePrefill:
    """The prefill role as a decode replica's HandleEngineClient reaches it (`prefill`: the
    request's one output and its KVTransferParams, as LLMServer.prefill answers), over an
    in-process prefill engine; `lost` raises what a dead prefill replica's call raises."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.lost = False
        self.calls = 0

    async def prefill(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                      request_id: str, cache_salt: str | None, routing_key: str | None,
                      lora_request: LoRARequest | None) -> tuple[RequestOutput, Any]:
        import ray.exceptions

        self.calls += 1
        if self.lost:
            raise ray.exceptions.ActorDiedError()
        last = None
        async for out in self.engine.generate(prompt_token_ids, sampling_params, request_id,
                                               cache_salt=cache_salt, export_kv=True,
                                               lora_request=lora_request):
            last = out
        assert last is not None
        return last, last.kv_transfer_params


@pytest.fixture(scope="module")
def engines(tiny_model_path: str) -> Iterator[tuple[AsyncLLMEngine, ...]]:
    """(prefill, decode, colocated) engines, in-process (no Ray: a payload is its tensor)."""
    def make(**kw: Any) -> AsyncLLMEngine:
        return AsyncLLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=8,
                                           swap_space=0.01, **kw))

    made = (make(kv_role="prefill"), make(kv_role="decode"), make())
    yield made
    for e in made:
        e.shutdown()


@pytest.fixture(autouse=True)
def _no_leak(engines: tuple[AsyncLLMEngine, ...]) -> Iterator[None]:
    yield
    for e in engines:
        kv = e.engine.scheduler.kv
        kv.check_invariants()
        assert kv.num_free_gpu_blocks == kv.num_gpu_blocks


def _collect(stream: Any) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        return [out async for out in stream]
    return asyncio.run(run())


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.outputs[0].token_ids]


def _colocated(engine: AsyncLLMEngine, rid: str, params: SamplingParams) -> list[int]:
    return _tokens(_collect(engine.generate(PROMPT, params, rid)))


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_first_token_from_the_prefill_then_the_imported_rest_equal_colocated(
        engines: tuple, params: SamplingParams) -> None:
    p, d, c = engines
    rid = f"pd-{params.temperature}"
    want = _colocated(c, rid, params)
    exports, imports = (p.metrics()["kv_transfer_exports_total"],
                        d.metrics()["kv_transfer_imports_total"])
    prefill = EnginePrefill(p)
    outs = _collect(decode_after_prefill(prefill, d, PROMPT, params, rid, None, None, None))
    assert _tokens(outs) == want
    # the first output is the prefill's token alone, not finished; the last finishes by length
    assert outs[0].outputs[0].token_ids == want[:1] and not outs[0].finished
    assert outs[0].outputs[0].finish_reason is None
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert prefill.calls == 1
    assert p.metrics()["kv_transfer_exports_total"] == exports + 1
    after = d.metrics()
    assert after["kv_transfer_imports_total"] == imports + 1
    assert after["kv_transfer_fallbacks_total"] == 0


def test_a_lost_prefill_replica_leaves_the_whole_request_to_the_decode_side(
        engines: tuple) -> None:
    p, d, c = engines
    want = _colocated(c, "lost", GREEDY)
    before = d.metrics()
    prefill = EnginePrefill(p)
    prefill.lost = True
    outs = _collect(decode_after_prefill(prefill, d, PROMPT, GREEDY, "lost", None, None, None))
    assert _tokens(outs) == want and outs[-1].finished
    assert prefill.calls == 1
    after = d.metrics()  # no transfer: the decode engine computed the prompt itself
    assert after["kv_transfer_imports_total"] == before["kv_transfer_imports_total"]
    assert after["kv_transfer_fallbacks_total"] == before["kv_transfer_fallbacks_total"]


def test_a_first_token_that_ends_the_request_is_the_whole_stream(engines: tuple) -> None:
    p, d, c = engines
    first = _colocated(c, "stop-probe", GREEDY)[0]
    before = d.metrics()["kv_transfer_imports_total"]
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first])
    outs = _collect(decode_after_prefill(EnginePrefill(p), d, PROMPT, params, "stop", None,
                                         None, None))
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].token_ids == [first]
    assert outs[0].outputs[0].finish_reason == "stop"
    assert d.metrics()["kv_transfer_imports_total"] == before  # nothing to decode, no import


def test_a_replica_without_a_prefill_role_refuses_a_disaggregated_request(
        engines: tuple) -> None:
    with pytest.raises(ValueError, match="decode replica of a pd app"):
        _collect(decode_after_prefill(None, engines[1], PROMPT, GREEDY, "none", None, None,
                                      None))


class Recorded:
    """A deployment's client that records the calls the ingress makes (no engine behind it:
    what is checked is which call the ingress makes, not its answer)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def generate(self, *args: Any, **kw: Any) -> list[Any]:
        self.calls.append(("generate", kw))
        return []

    async def prefill(self, *args: Any) -> None:
        self.calls.append(("prefill", {}))


@pytest.mark.parametrize(("params", "disaggregated"), [
    (GREEDY, True),
    (SamplingParams(max_tokens=8, n=2), False),
    (SamplingParams(max_tokens=1), False),
    (SamplingParams(max_tokens=8, prompt_logprobs=1), False)])
def test_the_ingress_opens_only_the_decode_stream(params: SamplingParams,
                                                  disaggregated: bool) -> None:
    """The ingress never calls the prefill role nor holds KV refs: one decode stream, told
    whether its replica runs the prefill first (n > 1, max_tokens 1 and prompt logprobs run
    on the decode side alone)."""
    prefill, decode = Recorded(), Recorded()
    PDEngineClient(prefill, decode).generate(PROMPT, params, "r")
    assert prefill.calls == []
    assert decode.calls == [("generate", {"disaggregated": disaggregated})]
