"""Decode attention at the sizes where a cache passes 2 GiB: which shapes fault, which are wrong.

The first GPU run of `kernels_bench.py` (2026-11-26, H100) faulted with an illegal address at
batch 32, ctx 32768 (a 2 GiB K cache) after every smaller shape ran. Each case here runs in a
process of its own (a CUDA fault ends the process) and is checked against a float32 gather +
softmax reference (relative error of the output), so one run says whether the fault follows the
cache's size in bytes, the batch, or the split-K path.

    python bench/attention_bounds.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (name, batch, ctx, total cache blocks (the table points at the highest ones), num_segments)
CASES = [
    ("b1 ctx32k, 2 GiB cache, top blocks", 1, 32768, 65536, None),
    ("b16 ctx32k, 1 GiB cache", 16, 32768, 32768, None),
    ("b32 ctx32k, 2 GiB cache, split 1", 32, 32768, 65536, 1),
    ("b32 ctx32k, 2 GiB cache", 32, 32768, 65536, None),
]


def run_case(batch: int, ctx: int, num_blocks: int, segments: int | None) -> dict:
    import torch

    from kernels.triton_attention import paged_attention

    bs, kv_heads, q_heads, dim = 16, 8, 16, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (num_blocks, bs, kv_heads, dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen)
    per_seq = ctx // bs
    top = torch.arange(num_blocks - batch * per_seq, num_blocks, device="cuda", dtype=torch.int32)
    table = top[torch.randperm(top.numel(), device="cuda", generator=gen)].view(batch, per_seq)
    q = torch.randn(batch, q_heads, dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    out = paged_attention(q, k_cache, v_cache, table, qsl, lens, dim ** -0.5, 1, ctx,
                          num_segments=segments)
    torch.cuda.synchronize()
    errs = []
    for b in range(batch):
        k = k_cache[table[b].long()].reshape(ctx, kv_heads, dim).float()
        v = v_cache[table[b].long()].reshape(ctx, kv_heads, dim).float()
        k, v = k.repeat_interleave(q_heads // kv_heads, 1), v.repeat_interleave(q_heads // kv_heads, 1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].float(), k) * dim ** -0.5, -1)
        ref = torch.einsum("ht,thd->hd", p, v)
        errs.append(((out[b].float() - ref).norm() / ref.norm()).item())
    return {"max_rel_err": max(errs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--case", type=int, help=argparse.SUPPRESS)  # one case, in a child process
    a = ap.parse_args()
    if a.case is not None:
        print(json.dumps(run_case(*CASES[a.case][1:])))
        return
    rows = []
    for i, (name, *_rest) in enumerate(CASES):
        try:
            p = subprocess.run([sys.executable, __file__, "--case", str(i)], capture_output=True,
                               text=True, timeout=60)
            last = (p.stdout.strip().splitlines() or [""])[-1]
            errors = [ln for ln in p.stderr.splitlines() if "Error" in ln] or ["?"]
            row = json.loads(last) if p.returncode == 0 else {"error": errors[-1][:300]}
        except subprocess.TimeoutExpired:
            row = {"error": "timed out after 60 s"}
        rows.append({"case": name} | row)
        print(json.dumps(rows[-1]), flush=True)
    if a.json:
        a.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
