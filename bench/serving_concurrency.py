"""bench/serving.py's requests at a fixed concurrency, against a server that is already running
(`./dev serve`): the workload guidellm runs with `--profile kind=concurrent,streams=N --data
kind=synthetic_text,prompt_tokens=P,output_tokens=O`, so the two tools' numbers can be put
side by side (docs/benchmarks.md, "guidellm beside bench/serving.py").

Each level keeps N requests in flight until `--requests` are done: prompts of exactly P random
token ids (fixed by the seed), O output tokens each (greedy, ignore_eos), streamed through
/v1/completions and timed by bench/serving.py's `one_request` (TTFT, inter-token latency).

  .venv/bin/python bench/serving_concurrency.py --url http://127.0.0.1:8000 \
      --concurrency 1 4 16 --requests 16 32 64 --prompt-tokens 128 --output-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import TOKEN_RANGE, Result, one_request, summarize  # noqa: E402


async def concurrent_load(url: str, requests: list[tuple[list[int], int]],
                          concurrency: int) -> tuple[list[Result], float]:
    """Every request, `concurrency` in flight at a time; (results, wall seconds)."""
    queue = list(reversed(requests))
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker() -> None:
            while queue:
                prompt, max_tokens = queue.pop()
                results.append(await one_request(client, url, prompt, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return results, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="a running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, nargs="+", default=[16, 32, 64],
                    help="requests per concurrency level (one number, or one per level)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    counts = args.requests * len(args.concurrency) if len(args.requests) == 1 else args.requests
    if len(counts) != len(args.concurrency):
        ap.error("--requests takes one number, or one per --concurrency level")
    rng = random.Random(args.seed)

    def make(n: int) -> list[tuple[list[int], int]]:
        return [([rng.randrange(*TOKEN_RANGE) for _ in range(args.prompt_tokens)],
                 args.output_tokens) for _ in range(n)]

    asyncio.run(concurrent_load(args.url, make(4), 2))  # warm-up
    rows: list[dict[str, Any]] = []
    for concurrency, n in zip(args.concurrency, counts):
        results, wall = asyncio.run(concurrent_load(args.url, make(n), concurrency))
        row = summarize("fixed", concurrency, results, wall)
        row["requests_per_s"] = row["completed"] / wall
        rows.append(row)
        print(f"concurrency {concurrency:3d}: {row['completed']}/{row['sent']} ok  "
              f"{row['requests_per_s']:.2f} req/s  {row['output_tok_per_s']:.1f} output tok/s  "
              f"TTFT p50 {row['ttft_p50_ms']:.0f} ms  ITL p50 {row['itl_p50_ms']:.1f} ms  "
              f"e2e p50 {row['e2e_p50_s']:.2f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
