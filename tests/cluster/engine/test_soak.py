"""Soak: 300 requests at concurrency 32 through the serving engine (tp 2 on Ray), on a KV
cache small enough that swap and recompute preemption both happen, with a worker killed by
SIGKILL in the middle. Nothing is lost, every greedy output equals a run without the kill and
without the tiny cache, no KV block leaks, and the engine is ready again."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from cluster.engine.async_llm_engine import AsyncLLMEngine
from cluster.engine.config import EngineConfig
from scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NUM_REQUESTS = 300
CONCURRENCY = 32


def _requests() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(15)
    return [([rng.randrange(100, 150000) for _ in range(rng.randrange(4, 30))],
             SamplingParams(temperature=0.0, max_tokens=rng.randrange(10, 40), ignore_eos=True))
            for _ in range(NUM_REQUESTS)]


async def _serve_all(engine: AsyncLLMEngine, requests: list, kill_after: int | None
                     ) -> tuple[list[list[int]], float | None]:
    """Every request through `engine.generate`, CONCURRENCY at a time; with `kill_after`,
    SIGKILL rank 1 once that many have finished. Returns the outputs and, after a kill, the
    seconds from the kill to the first token a request in flight then got from the rebuilt
    workers."""
    import ray

    gate = asyncio.Semaphore(CONCURRENCY)
    done = 0
    killed_at: float | None = None
    in_flight_then: set[str] = set()
    recovered_after: float | None = None
    outputs: list[list[int]] = [[] for _ in requests]
    active: set[str] = set()

    async def one(i: int, prompt: list[int], params: SamplingParams) -> None:
        nonlocal done, killed_at, recovered_after
        async with gate:
            rid = f"r{i}"
            active.add(rid)
            async for out in engine.generate(prompt, params, rid):
                outputs[i] += out.outputs[0].token_ids
                if (killed_at is not None and recovered_after is None and rid in in_flight_then
                        and engine.engine.recoveries and out.outputs[0].token_ids):
                    recovered_after = time.monotonic() - killed_at
            active.discard(rid)
            done += 1
            if kill_after is not None and done == kill_after and killed_at is None:
                pid = ray.get(engine.engine.executor.workers[1].pid.remote())
                in_flight_then.update(active)
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()

    await asyncio.gather(*(one(i, p, sp) for i, (p, sp) in enumerate(requests)))
    return outputs, recovered_after


def test_300_requests_survive_a_killed_worker_on_a_tiny_cache(ray_cluster: None) -> None:
    requests = _requests()
    base = dict(model="qwen3-tiny", tensor_parallel_size=2, worker_num_cpus=0.5,
                max_num_seqs=CONCURRENCY)
    # The reference (no kill, a cache that holds everything) runs beside the soak, in the
    # same event loop: each engine's step waits on its ranks, so the two overlap.
    reference = AsyncLLMEngine(EngineConfig(**base))
    # 30 blocks of 16 tokens for 32 sequences that grow to up to 68 tokens; 0.0001 GiB of
    # swap holds one or two of them, so some preemptions swap and the rest recompute.
    tiny = AsyncLLMEngine(EngineConfig(**base, num_gpu_blocks_override=30, swap_space=0.0001,
                                       preemption_mode="swap"))

    async def both() -> tuple:
        return await asyncio.gather(_serve_all(reference, requests, None),
                                    _serve_all(tiny, requests, kill_after=NUM_REQUESTS // 3))

    try:
        (expected, _), (got, recovered_after) = asyncio.run(asyncio.wait_for(both(),
                                                                             timeout=600))
        stats = tiny.engine.scheduler.stats()
        assert tiny.engine.recoveries == 1 and reference.engine.recoveries == 0
        assert stats.preemptions_swap > 0 and stats.preemptions_recompute > 0
        assert stats.num_free_gpu_blocks == stats.num_gpu_blocks  # nothing leaked
        assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
        tiny.engine.scheduler.kv.check_invariants()
        tiny.check_ready()  # /health says 200 again
        assert recovered_after is not None and recovered_after < 120
        print(f"first token of an interrupted request {recovered_after:.1f} s after the kill")
    finally:
        tiny.shutdown()
        reference.shutdown()
    lost = [i for i, out in enumerate(got) if len(out) != requests[i][1].max_tokens]
    assert not lost
    assert got == expected
