"""Structured outputs, offline A/B: the same requests with and without a JSON-schema constraint.

One engine, the runs interleaved (plain, json, plain, json, ...: this VM's speed drifts), each
`--requests` prompts of 32-256 random tokens, `--max-tokens` outputs, greedy, ignore_eos (a
constrained output that completes its JSON early goes on with EOS tokens, still constrained,
so both runs make the same tokens). Per run: output tok/s, wall ms per step, and the host
time of the structured-output hooks per step (marking the plan's constrained rows, filling
their bitmask, advancing the matchers: cluster/engine/structured_output.py). The constraint is
bench/serving.py's JSON_SCHEMA. Then the sampler alone on `--requests` greedy rows of random
logits, without and with a bitmask (workers/sampler.py's mask op), best of several.

    .venv/bin/python bench/structured_bench.py [--reps 3] [--set executor=ray] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from serving import JSON_SCHEMA  # noqa: E402


def run(llm: Any, prompts: list[dict], max_tokens: int, constrained: bool) -> dict[str, float]:
    from cluster import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=JSON_SCHEMA) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            structured_outputs=so)
    eng = llm.engine
    steps0, hooks0 = eng.num_steps, eng.structured.hook_seconds
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps = eng.num_steps - steps0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"tok_per_s": tokens / wall, "ms_per_step": 1e3 * wall / steps,
            "hook_ms_per_step": 1e3 * (eng.structured.hook_seconds - hooks0) / steps}


def sampler_ms(rows: int, vocab: int, reps: int = 20) -> tuple[float, float]:
    """(ms per call without a bitmask, with one) of the Sampler on greedy rows, best of 3."""
    import torch

    from workers.sampler import Sampler, SamplingMetadata

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen)
    mask = torch.randint(-2**31, 2**31 - 1, (rows, -(-vocab // 32)), dtype=torch.int32,
                         generator=gen)
    sampler = Sampler()
    out = []
    for bitmask in (None, mask):
        md = SamplingMetadata(
            temperature=torch.zeros(rows), all_greedy=True, top_k=None, top_p=None, min_p=None,
            rng_key=torch.zeros(rows, dtype=torch.int64),
            rng_counter=torch.zeros(rows, dtype=torch.int64), penalties=None,
            max_num_logprobs=None, token_bitmask=bitmask)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(reps):
                sampler(logits, md)
            best = min(best, (time.perf_counter() - start) / reps)
        out.append(1e3 * best)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine argument, e.g. --set executor=ray")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from cluster import LLM, SamplingParams

    rng = random.Random(args.seed)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 150000)
                                     for _ in range(rng.randint(32, 256))]}
               for _ in range(args.requests)]
    engine_args = {"max_num_seqs": max(64, args.requests)}
    for item in args.set:
        key, _, value = item.partition("=")
        engine_args[key] = yaml.safe_load(value)
    rows: dict[str, list[dict[str, float]]] = {"plain": [], "json-schema": []}
    with LLM(args.model, **engine_args) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        run(llm, prompts[:4], 8, True)  # (and the grammar compiled)
        for rep in range(args.reps):
            for name in rows:
                rows[name].append(run(llm, prompts, args.max_tokens, name == "json-schema"))
                r = rows[name][-1]
                print(f"rep {rep} {name:>11}: {r['tok_per_s']:7.1f} tok/s  "
                      f"{r['ms_per_step']:7.2f} ms/step  hooks {r['hook_ms_per_step']:.3f} "
                      "ms/step", flush=True)
    median = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
              for name, runs in rows.items()}
    # Each rep's json-schema run against the plain run right before it: the pair shares the
    # VM's speed of the moment, which drifts more than the effect between reps.
    ratio = statistics.median(j["tok_per_s"] / p["tok_per_s"]
                              for p, j in zip(rows["plain"], rows["json-schema"]))
    print(f"median: plain {median['plain']['tok_per_s']:.1f} tok/s, json-schema "
          f"{median['json-schema']['tok_per_s']:.1f} tok/s; json-schema / plain per rep, "
          f"median {100 * ratio:.0f}%; hooks "
          f"{median['json-schema']['hook_ms_per_step']:.3f} ms of "
          f"{median['json-schema']['ms_per_step']:.2f} ms per constrained step")
    plain_ms, masked_ms = sampler_ms(args.requests, llm.engine.model_config.vocab_size)
    print(f"sampler, {args.requests} greedy rows: {plain_ms:.2f} ms, with a bitmask "
          f"{masked_ms:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps({"engine_args": engine_args, "runs": rows,
                                         "median": median, "ratio": ratio,
                                         "sampler_ms": {"plain": plain_ms, "bitmask": masked_ms}},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
