"""Re-admitting a request with the tokens another replica generated (the failover's engine
half, cluster/api/failover.py), and the stalled-engine health check.

One in-process engine (qwen3-tiny, tp 1) for the module: a resumed request must give the
tokens and the text the uninterrupted one gives after the same point.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.engine.async_llm_engine import AsyncLLMEngine
from cluster.engine.config import EngineConfig
from cluster.engine.errors import EngineStalledError
from cluster.engine.llm_engine import LLMEngine
from scheduler import SamplingParams

PROMPT = [9707, 11, 1879, 0, 576, 6722, 315, 9625, 374]


@pytest.fixture(scope="module")
def engine(tiny_model_path: str) -> Iterator[LLMEngine]:
    eng = LLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=8, swap_space=0.01))
    yield eng
    eng.shutdown()


def _run(engine: LLMEngine, rid: str, params: SamplingParams,
         resume: list[int] | None = None) -> tuple[list[int], list[str], str | None]:
    """(tokens, text of each delta, finish reason) of one request run alone."""
    engine.add_request(rid, PROMPT, params, output_token_ids=resume)
    tokens: list[int] = []
    texts: list[str] = []
    reason = None
    while engine.has_unfinished():
        for out in engine.step():
            comp = out.outputs[0]
            tokens += comp.token_ids
            texts.append(comp.text)
            reason = comp.finish_reason or reason
    return tokens, texts, reason


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=50, seed=7, repetition_penalty=1.3,
                   frequency_penalty=0.5, max_tokens=14, ignore_eos=True),
], ids=["greedy", "seeded", "seeded-penalties"])
@pytest.mark.parametrize("cut", [1, 6, 13])
def test_resumed_request_continues_with_the_same_tokens_and_text(
        engine: LLMEngine, params: SamplingParams, cut: int) -> None:
    tokens, texts, reason = _run(engine, f"whole-{cut}", params)
    assert len(tokens) == 14 and reason == "length"
    rest, rest_texts, rest_reason = _run(engine, f"resumed-{cut}", params, tokens[:cut])
    assert rest == tokens[cut:]
    # deltas of one token each: the client's text so far, then the resumed deltas
    assert "".join(texts[:cut]) + "".join(rest_texts) == "".join(texts)
    assert rest_reason == "length"


def test_resumed_request_stops_on_the_same_stop_string(engine: LLMEngine) -> None:
    sampling = dict(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True)
    tokens, texts, _ = _run(engine, "stop-probe", SamplingParams(**sampling))
    full = "".join(texts)
    # a stop string (spanning tokens) that first occurs where the 9th token's text begins
    start = len("".join(texts[:8]))
    stop = full[start:start + 6]
    assert len(stop) == 6 and full.index(stop) == start, full
    params = SamplingParams(**sampling, stop=[stop])
    whole, whole_texts, reason = _run(engine, "stop-whole", params)
    assert reason == "stop" and "".join(whole_texts) == full[:start]
    for cut in (3, 8):
        rest, rest_texts, rest_reason = _run(engine, f"stop-resumed-{cut}", params, whole[:cut])
        assert rest == whole[cut:] and rest_reason == "stop"
        assert "".join(whole_texts[:cut]) + "".join(rest_texts) == "".join(whole_texts)


def test_resuming_refuses_what_cannot_go_on(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="only a request with n=1 can be resumed"):
        engine.add_request("n2", PROMPT, SamplingParams(n=2, max_tokens=4), output_token_ids=[5])
    with pytest.raises(ValueError, match="it has finished already"):
        engine.add_request("done", PROMPT, SamplingParams(max_tokens=2),
                           output_token_ids=[5, 6])
    with pytest.raises(ValueError, match="resumed output token ids must be in"):
        engine.add_request("vocab", PROMPT, SamplingParams(max_tokens=4),
                           output_token_ids=[10 ** 7])
    assert not engine.has_unfinished()


def test_stalled_engine_fails_its_health_check_but_a_busy_or_idle_one_never() -> None:
    engine = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=8,
                                         engine_stall_timeout_s=0.5, swap_space=0.01))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    hung: concurrent.futures.Future = concurrent.futures.Future()

    async def busy() -> int:
        n = 0
        async for out in engine.generate(PROMPT, params, "busy"):
            engine.check_health()  # every step is progress
            n += len(out.outputs[0].token_ids)
        return n

    async def stalled() -> Any:
        real_next_step = engine.engine.next_step

        def next_step_that_hangs() -> Any:
            plan, _, start = real_next_step()
            return plan, hung, start  # the step's result never comes (a hung collective)

        engine.engine.next_step = next_step_that_hangs  # type: ignore[method-assign]
        stream = engine.generate(PROMPT, params, "stuck")
        task = asyncio.create_task(anext(stream))
        await asyncio.sleep(0.2)
        engine.check_health()  # not yet
        await asyncio.sleep(0.6)
        try:
            engine.check_health()
        except EngineStalledError as e:
            return e
        finally:
            # asyncio.run waits for the thread that waits on the hung step: free it
            hung.set_exception(RuntimeError("test over"))
            task.cancel()
        return None

    async def run() -> tuple[int, Any]:
        got = await busy()
        await asyncio.sleep(1.0)
        engine.check_health()  # idle for twice the timeout: healthy
        return got, await stalled()

    try:
        got, err = asyncio.run(asyncio.wait_for(run(), timeout=120))
        assert got == 40
        assert isinstance(err, EngineStalledError)
        assert "no step for" in str(err) and "engine_stall_timeout_s=0.5" in str(err)
    finally:
        engine.shutdown()


def test_engine_stall_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="engine_stall_timeout_s must be > 0 seconds"):
        EngineConfig(engine_stall_timeout_s=0)
