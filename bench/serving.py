"""HTTP serving benchmark: Poisson arrivals against the Ray Serve app (BENCHMARKS.md `serving-cpu`).

Starts a Ray cluster and the app from a manifest (default manifests/qwen3-tiny.yaml), then:
  1. HTTP overhead at concurrency 1: the same prompts, one at a time, over HTTP (stream) and
     through an in-process AsyncLLMEngine with the same engine config; overhead = difference
     of median TTFT (the HTTP path: proxy, ingress, tokenization, handle, SSE), and per
     request: TTFT over HTTP minus that request's TTFT inside the replica's engine (from
     /metrics), which is free of prompt-to-prompt engine variance (`--overhead-only`: this
     step alone);
  2. for each request rate and each workload (`random`: prompts uniform 32-256 tokens;
     `shared-prefix`: a 256-token prefix shared by all + uniform 16-64 own tokens;
     `json-schema`: `random`'s requests, each constrained by JSON_SCHEMA through
     response_format), Poisson arrivals for `--duration` s (the same arrivals for every
     workload at a rate, the workloads run back to back: an A/B); outputs uniform 16-64
     tokens, greedy, ignore_eos (a constrained output that completes its JSON early goes on
     with EOS tokens, still constrained, so both runs make the same tokens).
Prints a table, writes `--json PATH` and a PNG of latency vs load (`--plot PATH`). Failed
requests are counted per reason: `http_<status>`, a transport error's exception type
(ReadTimeout, RemoteProtocolError, ...), or `sse_error`/`empty_stream` for a 200 with no token.

  RAY_AUTH_MODE=disabled .venv/bin/python bench/serving.py --duration 30 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import struct
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from workers.distributed import get_free_port  # noqa: E402

TOKEN_RANGE = (100, 150000)
# Requests' prompts by workload: the seed offset (json-schema reuses random's requests).
WORKLOAD_SEEDS = {"random": 10, "shared-prefix": 11, "json-schema": 10}
# The json-schema workload's constraint: nested objects, an array, numbers with bounds, enums.
JSON_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["id", "items"],
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "items": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "price", "tag"],
            "properties": {"name": {"type": "string"},
                           "price": {"type": "number", "minimum": 0, "maximum": 1000},
                           "tag": {"enum": ["new", "used", "refurbished"]}}}}}}


@dataclass(slots=True)
class Result:
    ok: bool
    status: int = 200
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    # Why a request failed (see `failure_reason`); "" while it has not.
    error: str = ""


def failure_reason(status: int, exc: BaseException | None = None, sse_error: bool = False) -> str:
    """A failure's key in the breakdown: "http_<status>" for an HTTP error status, the
    exception's type for a transport error (ReadTimeout, RemoteProtocolError, ...), and for a
    200 that streamed no token "sse_error" (an in-band error chunk) or "empty_stream"."""
    if exc is not None:
        return type(exc).__name__
    if status != 200:
        return f"http_{status}"
    return "sse_error" if sse_error else "empty_stream"


def failure_breakdown(results: list[Result]) -> dict[str, int]:
    """Failed requests per reason, most frequent first (ties by name)."""
    counts: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error or failure_reason(r.status)
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def format_failures(failures: dict[str, int]) -> str:
    """`failure_breakdown` for the table: "http_503=12 ReadTimeout=3", "-" when none."""
    return " ".join(f"{k}={v}" for k, v in failures.items()) or "-"


def make_requests(workload: str, n: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request, fixed by `seed`."""
    rng = random.Random(seed)
    prefix = [rng.randrange(*TOKEN_RANGE) for _ in range(256)]
    out = []
    for _ in range(n):
        if workload in ("random", "json-schema"):
            prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(rng.randint(32, 256))]
        elif workload == "shared-prefix":
            prompt = prefix + [rng.randrange(*TOKEN_RANGE) for _ in range(rng.randint(16, 64))]
        else:
            raise ValueError(f"workload must be one of {list(WORKLOAD_SEEDS)}; got {workload!r}")
        out.append((prompt, rng.randint(16, 64)))
    return out


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int],
                      max_tokens: int, extra: dict[str, Any] | None = None) -> Result:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, **(extra or {})}
    start = time.perf_counter()
    last = start
    res = Result(ok=False)
    sse_error = False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                res.error = failure_reason(res.status)
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if not chunk.get("choices"):
                    sse_error = sse_error or "error" in chunk
                    continue  # the usage-only chunk, or an error sent after the headers
                # One chunk per engine step per request: a step adds one token.
                if res.output_tokens == 0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
                res.output_tokens += 1
    except httpx.HTTPError as e:
        res.error = failure_reason(res.status, e)
        return res
    res.e2e = time.perf_counter() - start
    res.ok = res.output_tokens > 0
    if not res.ok:
        res.error = failure_reason(res.status, sse_error=sse_error)
    return res


def workload_body(workload: str) -> dict[str, Any]:
    """What a workload adds to each request's body."""
    if workload == "json-schema":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "order", "schema": JSON_SCHEMA}}}
    return {}


async def poisson_load(url: str, requests: list[tuple[list[int], int]], rate: float,
                       duration: float, seed: int,
                       extra: dict[str, Any] | None = None) -> tuple[list[Result], float]:
    rng = random.Random(seed)
    tasks = []
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        t = 0.0
        i = 0
        while True:
            t += rng.expovariate(rate)
            if t > duration:
                break
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt, max_tokens = requests[i % len(requests)]
            tasks.append(asyncio.create_task(one_request(client, url, prompt, max_tokens, extra)))
            i += 1
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return list(results), wall


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def summarize(workload: str, rate: float, results: list[Result], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itls]
    return {"workload": workload, "rate": rate, "sent": len(results), "completed": len(ok),
            "failed": len(results) - len(ok), "failures": failure_breakdown(results),
            "output_tok_per_s": sum(r.output_tokens for r in ok) / wall,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
            "e2e_p50_s": pct([r.e2e for r in ok], 50)}


async def http_ttft_c1(url: str, requests: list[tuple[list[int], int]]
                       ) -> tuple[list[float], list[float]]:
    """(TTFT over HTTP, the replica engine's own TTFT) per request, one request at a time."""
    out, engine = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for prompt, _ in requests:
            before = engine_ttft(url)
            r = await one_request(client, url, prompt, 16)
            after = engine_ttft(url)
            out.append(r.ttft)
            engine.append(after[0] - before[0])
    return out, engine


async def offline_ttft_c1(engine: Any, requests: list[tuple[list[int], int]]) -> list[float]:
    from scheduler.sampling_params import SamplingParams

    out = []
    for i, (prompt, _) in enumerate(requests):
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        start = time.perf_counter()
        first = None
        async for _delta in engine.generate(prompt, sp, f"offline-{i}"):
            if first is None:
                first = time.perf_counter() - start
        out.append(first)
    return out


def engine_ttft(url: str) -> tuple[float, float]:
    """(sum, count) of the engine's vllm:time_to_first_token_seconds, from /metrics."""
    from cluster.api.prometheus import parse_prometheus

    m = parse_prometheus(httpx.get(f"{url}/metrics", timeout=30).text)
    name = "vllm:time_to_first_token_seconds"
    return (next(v for k, v in m.items() if k.startswith(name + "_sum")),
            next(v for k, v in m.items() if k.startswith(name + "_count")))


def start_app(manifest: Path, port: int, overrides: list[str]) -> tuple[str, dict[str, Any]]:
    import ray
    from ray import serve

    from cluster.api.serve_app import build_app
    from cluster.api.serve_env import apply_proxy_env

    apply_proxy_env()  # read by Serve's HTTP front, which ray.init starts
    args = dict(yaml.safe_load(manifest.read_text())["applications"][0]["args"])
    args.pop("api_key", None)
    for item in overrides:
        key, _, value = item.partition("=")
        args[key] = yaml.safe_load(value)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}", args


# ---- a PNG line plot without matplotlib (not installed here) -------------------------------

_FONT = {  # 3x5 glyphs, rows top to bottom, 3 bits each
    "0": "75557", "1": "26227", "2": "71747", "3": "71717", "4": "55711", "5": "74717",
    "6": "74757", "7": "71111", "8": "75757", "9": "75717", ".": "00002", "-": "00700",
    " ": "00000", "/": "11244", "E": "74647", "Q": "75571", "R": "65655", "S": "74717",
    "M": "57755", "T": "72222", "F": "74644", "P": "75744", "I": "72227", "L": "44447",
    "A": "25755", "N": "75555", "D": "65556", "O": "75557", "H": "55755", "X": "55255",
    "C": "74447", "U": "55557", "K": "55655", "Y": "55222", "G": "74557", "B": "66566",
    "W": "55775", "V": "55552", "Z": "71247", "J": "11157",
}
_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75)]


def line_plot(path: Path, series: dict[str, list[tuple[float, float]]], x_label: str,
              y_label: str, log_y: bool = False, size: tuple[int, int] = (640, 420)) -> None:
    """Write `series` (name -> [(x, y)]) as a PNG line chart with axes, ticks and a legend."""
    import math

    w, h = size
    img = [[(255, 255, 255)] * w for _ in range(h)]
    left, right, top, bottom = 60, w - 170, 20, h - 40

    def put(x: int, y: int, c: tuple[int, int, int]) -> None:
        if 0 <= x < w and 0 <= y < h:
            img[y][x] = c

    def text(x: int, y: int, s: str, c: tuple[int, int, int] = (0, 0, 0), scale: int = 2) -> None:
        for ch in s.upper():
            rows = _FONT.get(ch, _FONT[" "])
            for r, bits in enumerate(rows):
                for b in range(3):
                    if int(bits, 16) >> (2 - b) & 1:
                        for dx in range(scale):
                            for dy in range(scale):
                                put(x + b * scale + dx, y + r * scale + dy, c)
            x += 4 * scale

    def line(x0: float, y0: float, x1: float, y1: float, c: tuple[int, int, int]) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i in range(n + 1):
            t = i / n
            for d in (0, 1):
                put(int(x0 + (x1 - x0) * t) + d, int(y0 + (y1 - y0) * t), c)

    pts = [p for s in series.values() for p in s if math.isfinite(p[1]) and p[1] > 0]
    if not pts:
        return
    fy = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    xs, ys = [p[0] for p in pts], [fy(p[1]) for p in pts]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = math.floor(min(ys)), math.ceil(max(ys)) if log_y else max(ys) * 1.1
    if y1 <= y0:
        y1 = y0 + 1

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (right - left)

    def sy(v: float) -> float:
        return bottom - (fy(v) - y0) / (y1 - y0) * (bottom - top)

    line(left, top, left, bottom, (0, 0, 0))
    line(left, bottom, right, bottom, (0, 0, 0))
    for x in sorted(set(xs)):
        line(sx(x), bottom, sx(x), bottom + 4, (0, 0, 0))
        text(int(sx(x)) - 8, bottom + 8, f"{x:g}")
    ticks = [10 ** e for e in range(int(y0), int(y1) + 1)] if log_y else \
        [y0 + (y1 - y0) * i / 4 for i in range(5)]
    for v in ticks:
        line(left - 4, sy(v), right, sy(v), (220, 220, 220))
        text(2, int(sy(v)) - 5, f"{v:g}")
    text(right - 60, bottom + 24, x_label)
    text(2, 4, y_label)
    for k, (name, s) in enumerate(series.items()):
        c = _COLORS[k % len(_COLORS)]
        good = [(x, y) for x, y in s if math.isfinite(y) and y > 0]
        for (xa, ya), (xb, yb) in zip(good, good[1:]):
            line(sx(xa), sy(ya), sx(xb), sy(yb), c)
        for x, y in good:
            for dx in range(-2, 3):
                for dy in range(-2, 3):
                    put(int(sx(x)) + dx, int(sy(y)) + dy, c)
        ly = top + 14 * k
        for dx in range(10):
            for dy in range(6):
                put(right + 8 + dx, ly + 2 + dy, c)
        text(right + 22, ly, name.replace("shared-prefix", "PREFIX").replace("random", "RAND"),
             scale=1)

    raw = b"".join(b"\x00" + bytes(v for px in row for v in px) for row in img)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    path.write_bytes(png)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", type=Path, default=ROOT / "manifests" / "qwen3-tiny.yaml")
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0, 32.0])
    ap.add_argument("--workloads", nargs="+", default=["random", "shared-prefix"])
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    ap.add_argument("--c1-requests", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a manifest arg, e.g. --set tensor_parallel_size=1")
    ap.add_argument("--overhead-only", action="store_true",
                    help="measure only the concurrency-1 HTTP overhead (step 1), no load sweep")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, default=Path("serving_latency.png"))
    args = ap.parse_args()

    url, app_args = start_app(args.manifest, get_free_port(), args.set)

    # Warm up both paths (first forward passes, tokenizer caches, HTTP connections).
    warm = make_requests("random", 4, seed=args.seed + 100)
    asyncio.run(http_ttft_c1(url, warm))

    c1 = make_requests("random", args.c1_requests, seed=args.seed + 1)
    # The replica's own TTFT (arrival in the engine -> first token) of each request, so the
    # HTTP path's share is known per request, free of the prompt-to-prompt engine variance.
    http_ttfts, replica_ttfts = asyncio.run(http_ttft_c1(url, c1))
    replica_ttft_mean = statistics.mean(replica_ttfts)

    from cluster.api.serve_app import SERVING_DEFAULTS
    from cluster.engine.async_llm_engine import AsyncLLMEngine
    from cluster.engine.config import EngineConfig

    engine_cfg = EngineConfig.from_dict({k: v for k, v in app_args.items()
                                         if k not in SERVING_DEFAULTS})
    engine = AsyncLLMEngine(engine_cfg)

    async def offline() -> list[float]:
        await offline_ttft_c1(engine, warm)
        return await offline_ttft_c1(engine, c1)

    offline_ttfts = asyncio.run(offline())
    engine.shutdown()
    overhead = {"http_ttft_p50_ms": 1e3 * statistics.median(http_ttfts),
                "offline_ttft_p50_ms": 1e3 * statistics.median(offline_ttfts),
                "per_request_diff_p50_ms": 1e3 * statistics.median(
                    [h - o for h, o in zip(http_ttfts, offline_ttfts)])}
    overhead["overhead_ms"] = overhead["http_ttft_p50_ms"] - overhead["offline_ttft_p50_ms"]
    overhead["http_ttft_mean_ms"] = 1e3 * statistics.mean(http_ttfts)
    overhead["replica_engine_ttft_mean_ms"] = 1e3 * replica_ttft_mean
    overhead["overhead_vs_replica_engine_ms"] = (overhead["http_ttft_mean_ms"]
                                                 - overhead["replica_engine_ttft_mean_ms"])
    overhead["overhead_vs_replica_engine_p50_ms"] = 1e3 * statistics.median(
        [h - e for h, e in zip(http_ttfts, replica_ttfts)])
    print(f"concurrency 1, {len(c1)} requests: TTFT p50 over HTTP "
          f"{overhead['http_ttft_p50_ms']:.1f} ms, offline {overhead['offline_ttft_p50_ms']:.1f} ms"
          f" -> HTTP overhead {overhead['overhead_ms']:.1f} ms "
          f"(median per-request diff {overhead['per_request_diff_p50_ms']:.1f} ms); mean TTFT over "
          f"HTTP {overhead['http_ttft_mean_ms']:.1f} ms vs the replica engine's own "
          f"{overhead['replica_engine_ttft_mean_ms']:.1f} ms -> "
          f"{overhead['overhead_vs_replica_engine_ms']:.1f} ms; per request, TTFT over HTTP minus "
          f"the replica engine's TTFT: p50 {overhead['overhead_vs_replica_engine_p50_ms']:.1f} ms")

    rows: list[dict[str, Any]] = []
    reqs = {w: make_requests(w, 4096, seed=args.seed + WORKLOAD_SEEDS[w]) for w in args.workloads}
    for rate in [] if args.overhead_only else args.rates:
        for workload in args.workloads:
            results, wall = asyncio.run(poisson_load(url, reqs[workload], rate, args.duration,
                                                     seed=args.seed + int(rate * 1000),
                                                     extra=workload_body(workload)))
            rows.append(summarize(workload, rate, results, wall))
            r = rows[-1]
            print(f"{workload:>13} {rate:6.1f} req/s  sent {r['sent']:4d} ok {r['completed']:4d} "
                  f"fail {r['failed']:3d}  {r['output_tok_per_s']:7.1f} tok/s  "
                  f"TTFT p50/p99 {r['ttft_p50_ms']:8.1f}/{r['ttft_p99_ms']:8.1f} ms  "
                  f"ITL p50/p99 {r['itl_p50_ms']:6.1f}/{r['itl_p99_ms']:6.1f} ms  "
                  f"failures {format_failures(r['failures'])}", flush=True)

    if rows:
        series = {}
        for workload in args.workloads:
            mine = [r for r in rows if r["workload"] == workload]
            series[f"{workload} TTFT p50"] = [(r["rate"], r["ttft_p50_ms"]) for r in mine]
            series[f"{workload} ITL p50"] = [(r["rate"], r["itl_p50_ms"]) for r in mine]
        line_plot(args.plot, series, x_label="REQ/S", y_label="MS", log_y=True)
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps({"overhead_c1": overhead, "rows": rows,
                                         "manifest": str(args.manifest),
                                         "duration_s": args.duration}, indent=2) + "\n")


if __name__ == "__main__":
    main()
