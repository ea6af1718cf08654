"""The engine loop's wake-ups on a request's first-token path: a step's result reaches the
loop from its future's own callback (executor.step_result, no waiting thread), and a request
that reaches an idle, parked engine starts its prefill at once, not at the next health probe."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

import pytest

from cluster.engine import async_llm_engine
from cluster.engine.async_llm_engine import AsyncLLMEngine
from cluster.engine.config import EngineConfig
from cluster.engine.executor import _Collect, step_result
from scheduler import SamplingParams


class _NoThreads(concurrent.futures.ThreadPoolExecutor):
    """A default executor that refuses work: `asyncio.to_thread` under it raises."""

    def submit(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        raise AssertionError("the loop asked for a helper thread")


def test_step_result_wakes_the_loop_from_the_futures_own_callback() -> None:
    """A helper thread's future (the in-process CPU executor's, a Ray group's) completes the
    await through its done-callback: no thread of the loop's default executor waits on it."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    release = threading.Event()

    async def run() -> str:
        asyncio.get_running_loop().set_default_executor(_NoThreads(1))
        future = pool.submit(lambda: release.wait(30) and "step 7")
        waiting = asyncio.ensure_future(step_result(future))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # it awaits the step, it does not poll or return early
        release.set()
        return await asyncio.wait_for(waiting, 30)

    try:
        assert asyncio.run(run()) == "step 7"
    finally:
        pool.shutdown()


def test_step_result_raises_the_steps_error() -> None:
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def fail() -> None:
        raise RuntimeError("rank 1 died")

    async def run() -> None:
        await step_result(pool.submit(fail))

    try:
        with pytest.raises(RuntimeError, match="rank 1 died"):
            asyncio.run(run())
    finally:
        pool.shutdown()


class _DeviceWorker:
    """What `_Collect` asks of a worker: whether a step's ids are back, and the blocking read."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.collect_threads: list[str] = []

    def step_ready(self, step_id: int) -> bool:
        return self.ready.is_set()

    def collect(self, step_id: int) -> list[str]:
        self.collect_threads.append(threading.current_thread().name)
        self.ready.wait(30)
        return [f"step {step_id}"]


def test_step_result_of_a_device_collect_waits_on_a_thread_not_the_loop() -> None:
    """`_Collect.result()` is the device wait itself: it runs off the event loop's thread."""
    worker = _DeviceWorker()

    async def run() -> str:
        waiting = asyncio.ensure_future(step_result(_Collect(worker, 3)))
        await asyncio.sleep(0.05)  # the loop still runs while the collect blocks
        assert not waiting.done() and len(worker.collect_threads) == 1
        worker.ready.set()
        return await asyncio.wait_for(waiting, 30)

    assert asyncio.run(run()) == "step 3"
    assert worker.collect_threads[0] != threading.main_thread().name


def test_cancelling_the_wait_leaves_the_step_to_finish() -> None:
    """The step loop's task cancelled (shutdown) while it awaits: the step is not cancelled."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    release = threading.Event()
    future = pool.submit(lambda: release.wait(30) and "done")

    async def run() -> None:
        waiting = asyncio.ensure_future(step_result(future))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    try:
        asyncio.run(run())
        assert not future.cancelled()
        release.set()
        assert future.result(30) == "done"
    finally:
        pool.shutdown()


def test_a_request_reaching_a_parked_engine_starts_without_waiting_for_the_probe(
        tiny_model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle engine parks and waits on its wake event, bounded by the health-probe period;
    a new request sets the event, so its prefill starts at once. With the period at an hour,
    a request that had to wait for the probe would not finish within the test's bound."""
    monkeypatch.setattr(async_llm_engine, "_HEALTH_PROBE_SECONDS", 3600.0)
    engine = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=4,
                                         max_num_batched_tokens=512))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [1000 + 31 * j for j in range(256)]

    async def tokens(rid: str) -> list[int]:
        return [t async for out in engine.generate(prompt, params, rid)
                for t in out.outputs[0].token_ids]

    async def run() -> tuple[list[int], list[int]]:
        first = await asyncio.wait_for(tokens("a"), 120)
        for _ in range(100):  # until the loop is parked on its wake event
            await asyncio.sleep(0.01)
            if not engine.engine.has_unfinished() and not engine._wake.is_set():
                break
        assert not engine.engine.has_unfinished() and not engine._task.done()
        second = await asyncio.wait_for(tokens("b"), 120)
        return first, second

    try:
        first, second = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(first) == 4 and first == second  # greedy: the same prompt, the same tokens
