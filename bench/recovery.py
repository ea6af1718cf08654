"""Recovery after a killed worker: how long a stream in flight waits, and when /health is 200.

Starts the tiny model with tp 2 on Ray through the serving engine (`AsyncLLMEngine`), streams
`--requests` greedy requests at once, and once every stream has its first tokens SIGKILLs one
rank (rank 1, then rank 0, alternating over `--trials`). Per trial:
  - `first_token_s`: from the kill to the first token a stream that was in flight then got
    from the rebuilt group (the recovery a client sees),
  - `ready_s`: from the kill to the engine being ready again (what /health reports),
  - `lost`: streams that ended short of max_tokens (must be 0),
  - `equal`: every output equals the run without a kill (greedy: recompute must not change it).

    .venv/bin/python bench/recovery.py --trials 3 --json recovery.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


async def _trial(engine, prompts: list[list[int]], params, kill_rank: int | None) -> dict:
    """Every prompt streamed at once; with `kill_rank`, that rank is SIGKILLed once every
    stream has a token."""
    import ray

    from cluster.engine.errors import EngineRecoveringError

    outputs: list[list[int]] = [[] for _ in prompts]
    started = asyncio.Event()
    killed_at: float | None = None
    first_token_s: float | None = None
    recoveries_before = engine.engine.recoveries

    async def one(i: int) -> None:
        nonlocal first_token_s
        async for out in engine.generate(prompts[i], params, f"t{time.monotonic_ns()}-{i}"):
            outputs[i] += out.outputs[0].token_ids
            if all(outputs):
                started.set()
            if (killed_at is not None and first_token_s is None and out.outputs[0].token_ids
                    and engine.engine.recoveries > recoveries_before):
                first_token_s = time.monotonic() - killed_at

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    ready_s = None
    if kill_rank is not None:
        await started.wait()
        pid = ray.get(engine.engine.executor.workers[kill_rank].pid.remote())
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while True:  # what /health asks
            try:
                engine.check_ready()
                if engine.engine.recoveries > recoveries_before:
                    ready_s = time.monotonic() - killed_at
                    break
            except EngineRecoveringError:
                pass
            await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)
    return {"outputs": outputs, "first_token_s": first_token_s, "ready_s": ready_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import random

    import ray

    from cluster.engine.async_llm_engine import AsyncLLMEngine
    from cluster.engine.config import EngineConfig
    from scheduler.sampling_params import SamplingParams

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    engine = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", tensor_parallel_size=2,
                                         worker_num_cpus=0.5))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 150000) for _ in range(rng.randrange(8, 64))]
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows: list[dict] = []

    async def run_all() -> None:  # one event loop: the engine's loop task lives in it
        expected = (await _trial(engine, prompts, params, None))["outputs"]
        for t in range(args.trials):
            got = await _trial(engine, prompts, params, kill_rank=1 - t % 2)
            lost = sum(len(o) != args.max_tokens for o in got["outputs"])
            rows.append({"killed_rank": 1 - t % 2, "first_token_s": got["first_token_s"],
                         "ready_s": got["ready_s"], "lost": lost,
                         "equal": got["outputs"] == expected})
            print(json.dumps(rows[-1]), flush=True)

    try:
        asyncio.run(run_all())
    finally:
        engine.shutdown()
        ray.shutdown()
    summary = {"trials": rows, "requests": args.requests, "max_tokens": args.max_tokens,
               "median_first_token_s": statistics.median(r["first_token_s"] for r in rows),
               "median_ready_s": statistics.median(r["ready_s"] for r in rows)}
    print(json.dumps({k: v for k, v in summary.items() if k != "trials"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
