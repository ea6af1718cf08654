"""One request at a time through `AsyncLLMEngine` in this process, no HTTP: TTFT and ITL of
`vllm bench serve`'s served shape (random 256-token prompts, 64 greedy output tokens,
ignore_eos), qwen3-tiny fp32 on CPU, the CPU manifests' engine keys (`max_num_batched_tokens`
512). Set beside a served run at concurrency 1 (`bench/peer_vllm.py --served 1`), the
difference is what HTTP, the ingress and Serve add to each (issue #43).

tp 1 is the in-process executor (`manifests/qwen3-tiny-2x.yaml`'s replicas); tp 2 the Ray
executor with `worker_num_cpus` 0.5 (`manifests/qwen3-tiny.yaml`'s). The engine code that runs
is the tree on PYTHONPATH; this script only drives it.

    PYTHONPATH=. RAY_AUTH_MODE=disabled python bench/engine_c1.py [--tp 1] [--requests 24]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time


async def measure(tp: int, requests: int) -> dict[str, float]:
    from cluster.engine.async_llm_engine import AsyncLLMEngine
    from cluster.engine.config import EngineConfig
    from scheduler.sampling_params import SamplingParams

    kw = dict(executor="ray", worker_num_cpus=0.5) if tp > 1 else dict(executor="inprocess")
    engine = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", device="cpu",
                                         tensor_parallel_size=tp, max_num_batched_tokens=512,
                                         **kw))
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ttft, itl = [], []
    try:
        for i in range(requests + 2):  # the first two warm up
            prompt = [1000 + (i * 7919 + j * 31) % 50000 for j in range(256)]
            last = time.perf_counter()
            gaps = []
            async for _ in engine.generate(prompt, sp, request_id=f"c1-{i}"):
                now = time.perf_counter()
                gaps.append((now - last) * 1e3)
                last = now
            if i >= 2:
                ttft.append(gaps[0])
                itl += gaps[1:]
    finally:
        engine.shutdown()
    return {"tp": tp, "ttft_median_ms": statistics.median(ttft), "ttft_min_ms": min(ttft),
            "itl_median_ms": statistics.median(itl), "itl_p99_ms": statistics.quantiles(
                itl, n=100)[98], "requests": requests, "load": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1, choices=[1, 2])
    ap.add_argument("--requests", type=int, default=24)
    args = ap.parse_args(argv)
    if args.tp > 1:
        import ray

        ray.init("local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    out = asyncio.run(measure(args.tp, args.requests))
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
