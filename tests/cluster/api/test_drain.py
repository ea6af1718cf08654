"""The drain hand-off (cluster/api/drain.py) on a real engine, without Serve: a draining
replica admits nothing, lets requests run for HANDOFF_AFTER of its graceful shutdown timeout,
then hands the rest over; the ingress's failover (cluster/api/failover.py) resumes them and the
client gets the tokens of an uninterrupted run.

One in-process engine (qwen3-tiny, tp 1) plays both replicas: each "replica" is a Drain in
front of it, as each LLMServer has one in front of its engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from cluster.api.drain import HANDOFF, HANDOFF_AFTER, Drain
from cluster.api.failover import ReplicaDrainingError, resuming_stream
from cluster.api.handle_client import pack_output, unpack_output
from cluster.api.serve_app import split_args
from cluster.engine.async_llm_engine import AsyncLLMEngine
from cluster.engine.config import EngineConfig
from scheduler import RequestOutput, SamplingParams

PROMPTS = [[9707, 11, 1879, 0, 576, 6722, 315, 9625, 374], [785, 3974, 13876, 38835, 34208]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_path: str) -> Iterator[AsyncLLMEngine]:
    eng = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=8, swap_space=0.01))
    yield eng
    eng.shutdown()


async def _replica(drain: Drain, engine: AsyncLLMEngine, prompt: list[int],
                   params: SamplingParams, rid: str,
                   resume: list[int] | None) -> AsyncIterator[RequestOutput]:
    """What LLMServer.generate and HandleEngineClient._generate do around the engine."""
    def packed() -> AsyncIterator[tuple]:
        async def gen() -> AsyncIterator[tuple]:
            async for out in engine.generate(prompt, params, rid, resume_token_ids=resume):
                yield pack_output(out)
        return gen()

    async for item in drain.stream(rid, params.n, packed):
        if item == HANDOFF:
            raise ReplicaDrainingError(rid)
        yield unpack_output(rid, prompt, item)


async def _request(engine: AsyncLLMEngine, drains: list[Drain], prompt: list[int],
                   params: SamplingParams, rid: str, opened: list[list[int]],
                   first: asyncio.Event | None = None) -> list[list[int]]:
    """A request through resuming_stream; its n-th opening goes to drains[n] (the last one
    from then on). Returns each choice's tokens; `opened` gets each opening's resume tokens."""
    def open_stream(resume: list[int]) -> AsyncIterator[RequestOutput]:
        drain = drains[min(len(opened), len(drains) - 1)]
        opened.append(list(resume))
        return _replica(drain, engine, prompt, params, rid, resume or None)

    tokens: list[list[int]] = [[] for _ in range(params.n)]
    async for out in resuming_stream(open_stream, rid, params.n):
        for comp in out.outputs:
            tokens[comp.index] += comp.token_ids
        if first is not None:
            first.set()
    return tokens


def _idle(engine: AsyncLLMEngine) -> bool:
    m = engine.metrics()
    return (not engine.engine.has_unfinished() and m["kv_cache_usage_perc"] == 0.0
            and m["num_requests_running"] == 0)


def test_a_draining_replica_hands_unfinished_requests_over_and_they_go_on_unchanged(
        engine: AsyncLLMEngine) -> None:
    async def run() -> tuple[list, list, list]:
        reference = [await _request(engine, [Drain(engine.abort)], p, GREEDY, f"ref-{i}", [])
                     for i, p in enumerate(PROMPTS)]
        draining, other = Drain(engine.abort), Drain(engine.abort)
        opened: list[list[list[int]]] = [[] for _ in PROMPTS]
        firsts = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.create_task(_request(engine, [draining, other], p, GREEDY, f"r-{i}",
                                              opened[i], firsts[i]))
                 for i, p in enumerate(PROMPTS)]
        await asyncio.gather(*(f.wait() for f in firsts))
        draining.begin(0.3 / HANDOFF_AFTER)  # hands over 0.3 s from now
        got = await asyncio.gather(*tasks)
        return reference, got, opened

    reference, got, opened = asyncio.run(asyncio.wait_for(run(), timeout=300))
    assert got == reference
    for resumes in opened:  # once on the draining replica, then from its tokens elsewhere
        assert len(resumes) == 2 and resumes[0] == []
        assert 0 < len(resumes[1]) < GREEDY.max_tokens
    assert _idle(engine)


def test_a_draining_replica_admits_nothing_but_keeps_requests_with_n_above_1(
        engine: AsyncLLMEngine) -> None:
    async def run() -> tuple[list, list, list]:
        draining = Drain(engine.abort)
        draining.begin(30.0)  # before it served anything
        assert draining.draining
        other = Drain(engine.abort)
        opened: list[list[int]] = []
        one = await _request(engine, [draining, other], PROMPTS[0], GREEDY, "late", opened)
        reference = await _request(engine, [other], PROMPTS[0], GREEDY, "late-ref", [])
        two = await _request(engine, [draining], PROMPTS[1],
                             SamplingParams(n=2, temperature=0.0, max_tokens=8,
                                            ignore_eos=True), "n2", [])
        return [one, reference], opened, two

    (one, reference), opened, two = asyncio.run(asyncio.wait_for(run(), timeout=300))
    assert opened == [[], []]  # handed over before its first token
    assert one == reference
    assert [len(t) for t in two] == [8, 8]  # n=2: served where it was, never handed over
    assert _idle(engine)


def test_what_ends_before_the_hand_off_ends_on_the_draining_replica(
        engine: AsyncLLMEngine) -> None:
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def run() -> tuple[list, list]:
        draining = Drain(engine.abort)
        opened: list[list[int]] = []
        first = asyncio.Event()
        task = asyncio.create_task(_request(engine, [draining, Drain(engine.abort)],
                                            PROMPTS[1], short, "short", opened, first))
        await first.wait()
        draining.begin(60.0 / HANDOFF_AFTER)
        return await task, opened

    got, opened = asyncio.run(asyncio.wait_for(run(), timeout=300))
    assert opened == [[]] and len(got[0]) == 6
    assert _idle(engine)


@pytest.mark.parametrize("key", ["graceful_shutdown_timeout_s",
                                 "ingress_graceful_shutdown_timeout_s",
                                 "health_check_period_s", "health_check_timeout_s"])
@pytest.mark.parametrize("value", [0, -1.0, True, "5"])
def test_shutdown_timeouts_must_be_positive_seconds(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{key} must be a number of seconds > 0; got"):
        split_args({"model": "qwen3-tiny", key: value})
    _, serving = split_args({"model": "qwen3-tiny", key: 2.5})
    assert serving[key] == 2.5
