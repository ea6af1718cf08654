"""One offline workload through two source trees' engines, alternating, one process at a time.

Each round starts a child process per tree (`PYTHONPATH=<tree>`, in alternating order so
neither always runs first); the child builds one offline `LLM` (tp 1) as that tree builds it,
runs the workload once uncounted (the KV cache's pages are touched on first use) and once
timed, and prints its tok/s (wall), the 1-minute load average and a digest of its greedy
tokens. For A/B of changes a monkeypatch cannot reach (threads, the model's build): make a
detached worktree of the base commit (`git worktree add --detach DIR BASE`) and pass both.

    python bench/tree_ab.py BASE_TREE OUR_TREE [--workload qwen3-0.6b-bf16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# name: (model, dtype, requests, prompt tokens, output tokens): bench/peer_vllm.py's rows
WORKLOADS = {"qwen3-0.6b-bf16": ("qwen3-0.6b-random", "bfloat16", 16, (32, 128), (32, 64)),
             "offline-cpu": ("qwen3-tiny", "float32", 64, (32, 256), (32, 128))}

_CHILD = r"""
import hashlib, json, os, sys, time
sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "bench"))
import torch
from throughput import make_requests, model_path
from cluster import LLM, SamplingParams
model, dtype, n, prompt, output = json.loads(sys.argv[1])
reqs = make_requests(dict(n=n, prompt=tuple(prompt), output=tuple(output)))
llm = LLM(model_path(model), dtype=dtype, seed=0)
prompts = [{"prompt_token_ids": p} for p, _ in reqs]
params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
llm.generate(prompts, params, use_tqdm=False)
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
wall = time.perf_counter() - start
tokens = [list(o.outputs[0].token_ids) for o in outs]
print(json.dumps({"tok_per_s": sum(map(len, tokens)) / wall, "load": os.getloadavg()[0],
                  "threads": torch.get_num_threads(),
                  "digest": hashlib.sha1(repr(tokens).encode()).hexdigest()[:12]}))
"""


def run_child(tree: str, workload: tuple) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(workload)], env=env,
                          cwd=tree, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("ours")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="qwen3-0.6b-bf16")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    trees = {"base": str(Path(args.base).resolve()), "ours": str(Path(args.ours).resolve())}
    rates: dict[str, list[float]] = {"base": [], "ours": []}
    for r in range(args.rounds):
        order = ["base", "ours"] if r % 2 == 0 else ["ours", "base"]
        got = {name: run_child(trees[name], WORKLOADS[args.workload]) for name in order}
        for name in order:
            rates[name].append(got[name]["tok_per_s"])
        print(f"pair {r + 1}: " + ", ".join(
            f"{name} {got[name]['tok_per_s']:.1f} tok/s ({got[name]['threads']} threads, load "
            f"{got[name]['load']:.1f}, tokens {got[name]['digest']})" for name in order),
            flush=True)
    base, ours = statistics.median(rates["base"]), statistics.median(rates["ours"])
    wins = sum(o > b for o, b in zip(rates["ours"], rates["base"]))
    print(f"{args.workload}: median base {base:.1f}, ours {ours:.1f} tok/s ({ours / base:.2f}x; "
          f"ours faster in {wins} of {args.rounds} pairs)")


if __name__ == "__main__":
    main()
