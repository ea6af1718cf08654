"""CPU decode attention: this tree's `kernels/cpu_attention.py` against another git ref's, interleaved.

A "step" is one decode batch's attention over `--layers` layers with the same metadata (what a
model's forward does): this tree makes its plan once per step into the step's cache, the other
ref's code does whatever it does per call. Shapes: Qwen3-0.6B's (16 q / 8 KV heads, head_dim 128,
bf16; B 16, contexts 32-200) and qwen3-tiny's (4 / 2 heads, head_dim 64, fp32; B 64 and 256,
contexts ~300), blocks of 16 scattered over the cache as a running server leaves them, one
torch thread (`--threads`: more). This tree's decode rows go to the C++ op when it is built
(scripts/bootstrap.sh), to its SDPA fallback otherwise. Each round times both back to back, so a shared machine's load hits them alike;
the table is the medians per step.

    python bench/cpu_decode_bench.py [--against main] [--rounds 9] [--layers 4] [--threads 1]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import cpu_attention  # noqa: E402

# name: (batch, shortest, longest context, q heads, KV heads, head_dim, dtype)
CASES = {"0.6b B16": (16, 32, 200, 16, 8, 128, torch.bfloat16),
         "tiny B64": (64, 250, 350, 4, 2, 64, torch.float32),
         "tiny B256": (256, 250, 350, 4, 2, 64, torch.float32)}
BLOCK_SIZE = 16


def load_ref(ref: str):  # noqa: ANN201 — a module object
    """`kernels/cpu_attention.py` as it is at git `ref`, imported under another name."""
    text = subprocess.run(["git", "show", f"{ref}:kernels/cpu_attention.py"], cwd=ROOT,
                          check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "cpu_attention_ref.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("cpu_attention_ref", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def make_case(batch: int, lo: int, hi: int, num_q: int, num_kv: int, head_dim: int,
              dtype: torch.dtype) -> tuple:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen)
    need = [-(-int(n) // BLOCK_SIZE) for n in lens]
    total = 2 * sum(need) + 1
    k_cache = torch.randn(total, BLOCK_SIZE, num_kv, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(total, BLOCK_SIZE, num_kv, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(total - 1, generator=gen) + 1
    tables = torch.zeros(batch, max(need), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = ids[used:used + n].int()
        used += n
    q = torch.randn(batch, num_q, head_dim, generator=gen).to(dtype)
    return (q, k_cache, v_cache, tables, torch.arange(batch + 1, dtype=torch.int32),
            lens.int(), head_dim ** -0.5)


def run(ref: str, rounds: int, layers: int, threads: int = 1) -> list[dict[str, object]]:
    torch.set_num_threads(threads)
    other = load_ref(ref)
    rows = []
    for name, shape in CASES.items():
        args = make_case(*shape)

        def ours(args: tuple = args) -> torch.Tensor:
            cache: dict = {}
            for _ in range(layers):
                out = cpu_attention.paged_attention(*args, step_cache=cache)
            return out

        def theirs(args: tuple = args) -> torch.Tensor:
            for _ in range(layers):
                out = other.paged_attention(*args)
            return out

        err = (ours().float() - theirs().float()).abs().max().item()
        times: dict[str, list[float]] = {"ours": [], ref: []}
        for _ in range(rounds):
            for key, fn in (("ours", ours), (ref, theirs)):
                start = time.perf_counter()
                fn()
                times[key].append((time.perf_counter() - start) / layers)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append({"case": name, f"{ref}_ms": round(ms[ref], 3), "ours_ms": round(ms["ours"], 3),
                     "speedup": round(ms[ref] / ms["ours"], 2), "max_abs_diff": err})
        print(f"{name:10s}  {ref} {ms[ref]:7.3f} ms  ours {ms['ours']:7.3f} ms  "
              f"x{ms[ref] / ms['ours']:.2f}  (max |diff| {err:.2e})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="main", help="git ref of the other cpu_attention.py")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--layers", type=int, default=4, help="layers per step (one plan)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = run(args.against, args.rounds, args.layers, args.threads)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
