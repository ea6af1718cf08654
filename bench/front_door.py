"""A small request's latency while big request bodies are in flight (#15's front-door probe).

Against one or more running servers (`--url LABEL=URL`, e.g. two builds of the app started
side by side), trials interleaved across them: the median latency of a 2-token completion
alone, then of the same request sent while `--bigs` requests with a `--big-mb` MB prompt
are on their way, and what the big requests got back (status, seconds). A server that reads
and tokenizes big prompts on its event loop shows it as the small request's latency.

  .venv/bin/python bench/front_door.py --url before=http://127.0.0.1:8001 \\
      --url after=http://127.0.0.1:8002 --trials 3 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx

SMALL = {"prompt": "Hello", "max_tokens": 2, "ignore_eos": True}


async def small_latency(c: httpx.AsyncClient, url: str) -> float:
    start = time.perf_counter()
    resp = await c.post(f"{url}/v1/completions", json=SMALL)
    resp.raise_for_status()
    return time.perf_counter() - start


async def big_request(c: httpx.AsyncClient, url: str, body: bytes) -> tuple[int, float]:
    start = time.perf_counter()
    resp = await c.post(f"{url}/v1/completions", content=body,
                        headers={"Content-Type": "application/json"})
    return resp.status_code, time.perf_counter() - start


async def trial(url: str, bigs: int, body: bytes, api_key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=600, headers=headers) as c:
        await small_latency(c, url)  # warm-up: connection, caches
        alone = statistics.median([await small_latency(c, url) for _ in range(5)])
        tasks = [asyncio.create_task(big_request(c, url, body)) for _ in range(bigs)]
        await asyncio.sleep(0)  # the big requests start sending first
        loaded = await small_latency(c, url)
        big = await asyncio.gather(*tasks)
    return {"alone_s": alone, "loaded_s": loaded, "big_status": [s for s, _ in big],
            "big_s": [t for _, t in big]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", action="append", required=True, metavar="LABEL=URL")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--bigs", type=int, default=3)
    ap.add_argument("--big-mb", type=float, default=5.0)
    ap.add_argument("--api-key")
    ap.add_argument("--json")
    args = ap.parse_args()
    servers = dict(item.split("=", 1) for item in args.url)
    body = json.dumps({"prompt": "x" * int(args.big_mb * 1e6), "max_tokens": 1}).encode()
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in servers}
    for i in range(args.trials):
        for label, url in servers.items():
            runs[label].append(asyncio.run(trial(url, args.bigs, body, args.api_key)))
            r = runs[label][-1]
            print(f"trial {i} {label}: alone {r['alone_s'] * 1e3:.1f} ms, loaded "
                  f"{r['loaded_s'] * 1e3:.1f} ms, big {r['big_status']} in "
                  f"{max(r['big_s']):.2f} s", flush=True)
    print(f"\n| server | small alone p50 | small with {args.bigs} x {args.big_mb:g} MB in flight"
          " | ratio | big requests | slowest big |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for label, rs in runs.items():
        alone = statistics.median(r["alone_s"] for r in rs)
        loaded = statistics.median(r["loaded_s"] for r in rs)
        statuses = sorted({s for r in rs for s in r["big_status"]})
        slowest = statistics.median(max(r["big_s"]) for r in rs)
        summary[label] = {"alone_s": alone, "loaded_s": loaded, "big_statuses": statuses,
                          "slowest_big_s": slowest, "trials": rs}
        print(f"| {label} | {alone * 1e3:.1f} ms | {loaded * 1e3:.1f} ms | "
              f"{loaded / alone:.1f}x | {', '.join(map(str, statuses))} | {slowest:.2f} s |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
