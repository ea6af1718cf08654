"""Mixture-of-experts benchmark: the fused path against a per-expert loop on the same inputs.

Kernel mode (default): one sparse MLP block's experts at Qwen3-30B-A3B's shapes (hidden 2048,
moe_intermediate 768 split over --tp ranks, 128 experts, 8 active), random router logits
(seeded), for several token counts. Rows:

* fused: `kernels.fused_moe` with backend auto (the torch twin on CPU, Triton on CUDA);
* loop: one expert at a time (transformers' Qwen3MoeExperts algorithm: `torch.where` per
  expert, two matmuls, `index_add_`);
* dense: a dense MLP with the same active parameters (intermediate k * I), the floor a
  grouped GEMM can approach;
* fp8 (`--fp8`): the same experts in Qwen's FP8 format (128x128 blocks) through the W8A8
  fused kernels, its speedup over `fused`, and its largest difference from the torch twin.

Bandwidth = bytes of the experts actually read (distinct experts hit x 3 H I x itemsize)
/ time. CPU: median of --runs wall-clock runs. CUDA: Triton's do_bench (the fused path and
the dense GEMMs as CUDA-graph replays, the loop eagerly, as it syncs per expert).

`--sweep-tiles` (CUDA) times each candidate tile configuration of the Triton kernel per
token count and prints the fastest: the rows for kernels/triton_moe.py's `_TILE_TABLE`.

`--offline` (CUDA): the `offline-gpu` workload (bench/throughput.py) through the engine with
Qwen3-30B-A3B's config against dense Qwen3-4B's, random weights, bf16: output tokens/s.
The 30B checkpoint is 57 GiB on disk; `--layers 12` writes a quarter of its layers.

    python bench/moe_bench.py [--device cpu|cuda] [--tokens 1 16 128] [--tp 1] [--fp8] [--json out]
    python bench/moe_bench.py --device cuda --sweep-tiles
    python bench/moe_bench.py --offline [--layers 48] [--tp 2] [--expert-parallel]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import ops  # noqa: E402
from kernels.fp8_reference import quantize_weight_blocks  # noqa: E402

SEED = 0
FP8_BLOCK = (128, 128)
SHAPES = {"30b-a3b": dict(hidden=2048, inter=768, experts=128, top_k=8),
          "235b-a22b": dict(hidden=4096, inter=1536, experts=128, top_k=8)}
# Dense Qwen3-4B (the offline comparison's dense model), random weights.
QWEN3_4B_CONFIG = {
    "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": True, "dtype": "bfloat16",
}


def per_expert_loop(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel():
            h = x[tok] @ w13[e].T
            y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].T
            out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


def dense_mlp(x, w13_dense, w2_dense):
    h = x @ w13_dense.T
    inter = w2_dense.shape[1]
    return (F.silu(h[:, :inter]) * h[:, inter:]) @ w2_dense.T


def _time(fn, device: str, runs: int, graph: bool = True) -> float:
    """Milliseconds per call."""
    if device == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        return do_bench_cudagraph(fn) if graph else do_bench(fn)
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def kernel_rows(args) -> list[dict]:
    shape = SHAPES[args.shape]
    h, e, k = shape["hidden"], shape["experts"], shape["top_k"]
    inter = shape["inter"] // args.tp
    dtype = {"auto": torch.bfloat16 if args.device == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    g = torch.Generator().manual_seed(SEED)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * 0.02).to(args.device, dtype)
    w2 = (torch.randn(e, h, inter, generator=g) * 0.02).to(args.device, dtype)
    w13_dense = (torch.randn(2 * k * inter, h, generator=g) * 0.02).to(args.device, dtype)
    w2_dense = (torch.randn(h, k * inter, generator=g) * 0.02).to(args.device, dtype)
    fp8 = (_fp8_experts(w13), _fp8_experts(w2)) if args.fp8 else None
    rows = []
    for t in args.tokens:
        x = torch.randn(t, h, generator=g).to(args.device, dtype)
        logits = torch.randn(t, e, generator=g).to(args.device, dtype)
        weights, ids = ops.moe_route(logits, k, True)
        hit = int(torch.unique(ids).numel())
        expert_bytes = hit * 3 * h * inter * w13.element_size()
        fused = _time(functools.partial(ops.fused_moe, x, w13, w2, weights, ids), args.device,
                      args.runs)
        loop = _time(functools.partial(per_expert_loop, x, w13, w2, weights, ids), args.device,
                     args.runs, graph=False)
        dense = _time(functools.partial(dense_mlp, x, w13_dense, w2_dense), args.device,
                      args.runs)
        err = (ops.fused_moe(x, w13, w2, weights, ids)
               - per_expert_loop(x, w13, w2, weights, ids)).abs().max().item()
        rows.append(dict(tokens=t, experts_hit=hit, fused_ms=round(fused, 3),
                         loop_ms=round(loop, 3), dense_ms=round(dense, 3),
                         speedup_vs_loop=round(loop / fused, 2),
                         fused_GBps=round(expert_bytes / fused / 1e6, 1),
                         loop_GBps=round(expert_bytes / loop / 1e6, 1), max_abs_diff=err))
        if fp8 is not None:
            rows[-1].update(_fp8_row(x, fp8, weights, ids, fused, args))
    return rows


def _fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts `[E, N, K]` in Qwen's FP8 format (128x128 blocks): (e4m3, float32 scales)."""
    pairs = [quantize_weight_blocks(e, FP8_BLOCK) for e in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _fp8_row(x, fp8, weights, ids, fused_ms: float, args) -> dict:
    """The FP8 experts (W8A8) on the same tokens: time, speedup over the model-dtype fused
    path, and the largest difference from the twin on the same FP8 experts."""
    (q13, s13), (q2, s2) = fp8
    run = functools.partial(ops.fused_moe, x, q13, q2, weights, ids, w13_scale=s13,
                            w2_scale=s2, block=FP8_BLOCK)
    ms = _time(run, args.device, args.runs)
    twin = ops.fused_moe(x, q13, q2, weights, ids, backend="torch", w13_scale=s13, w2_scale=s2,
                         block=FP8_BLOCK)
    return dict(fp8_ms=round(ms, 3), fp8_speedup=round(fused_ms / ms, 2),
                fp8_max_abs_diff_vs_twin=(run() - twin).abs().max().item())


def sweep_tiles(args) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    from kernels.triton_moe import fused_moe as triton_fused_moe

    shape = SHAPES[args.shape]
    h, e, k = shape["hidden"], shape["experts"], shape["top_k"]
    inter = shape["inter"] // args.tp
    g = torch.Generator().manual_seed(SEED)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * 0.02).cuda().bfloat16()
    w2 = (torch.randn(e, h, inter, generator=g) * 0.02).cuda().bfloat16()
    best = []
    for t in args.tokens:
        x = torch.randn(t, h, generator=g).cuda().bfloat16()
        weights, ids = ops.moe_route(torch.randn(t, e, generator=g).cuda(), k, True)
        results = []
        for bm, bn, bk, gm, warps, stages in itertools.product(
                (16, 32, 64, 128), (32, 64, 128), (64, 128), (1, 8), (4, 8), (3, 4)):
            tiles = (bm, bn, bk, gm, warps, stages)
            try:
                ms = do_bench_cudagraph(
                    functools.partial(triton_fused_moe, x, w13, w2, weights, ids, tiles))
            except Exception as exc:  # shared memory or register limits of this GPU
                print(f"  skip {tiles}: {type(exc).__name__}", file=sys.stderr)
                continue
            results.append((ms, tiles))
        ms, tiles = min(results)
        best.append(dict(tokens=t, pairs=t * k, best_ms=round(ms, 4), tiles=list(tiles)))
        print(best[-1], flush=True)
    return best


def offline(args) -> list[dict]:
    from throughput import WORKLOADS, make_requests

    from cluster import LLM, SamplingParams
    from workers.tiny_model import QWEN3_30B_A3B_CONFIG, cache_root, write_random_qwen3

    workload = WORKLOADS["offline-gpu"]
    reqs = make_requests(workload)
    moe = dict(QWEN3_30B_A3B_CONFIG, num_hidden_layers=args.layers)
    rows = []
    for name, cfg in ((f"qwen3-30b-a3b-{args.layers}l-random", moe),
                      ("qwen3-4b-random", QWEN3_4B_CONFIG)):
        target = cache_root() / name
        if not (target / "model.safetensors").is_file():
            write_random_qwen3(target, cfg, seed=SEED)
        params = [SamplingParams(temperature=workload["temperature"], max_tokens=o,
                                 ignore_eos=True, seed=i) for i, (_, o) in enumerate(reqs)]
        with LLM(str(target), tensor_parallel_size=args.tp,
                 enable_expert_parallel=args.expert_parallel) as llm:
            llm.generate([{"prompt_token_ids": reqs[0][0]}],
                         SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params,
                                use_tqdm=False)
            wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append(dict(model=name, tp=args.tp, expert_parallel=args.expert_parallel,
                         tok_per_s=round(tokens / wall, 1), wall_s=round(wall, 2)))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="30b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+")
    ap.add_argument("--tp", type=int, default=1, help="split the intermediate dim as TP does")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    ap.add_argument("--sweep-tiles", action="store_true")
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--expert-parallel", action="store_true", help="--offline: EP instead of TP")
    ap.add_argument("--fp8", action="store_true",
                    help="also the experts in Qwen's FP8 format (W8A8 fused kernels)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if (args.device == "cuda" or args.sweep_tiles or args.offline) and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(args.threads)
    args.tokens = args.tokens or ([1, 16, 128] if args.device == "cpu"
                                  else [1, 8, 32, 128, 512, 2048, 8192])
    if args.offline:
        rows = offline(args)
    elif args.sweep_tiles:
        rows = sweep_tiles(args)
    else:
        rows = kernel_rows(args)
        cols = list(rows[0])
        print(" | ".join(cols))
        for r in rows:
            print(" | ".join(str(r[c]) for c in cols))
    meta = dict(machine=platform.processor() or platform.machine(), torch=torch.__version__,
                threads=args.threads, shape=args.shape, tp=args.tp, device=args.device)
    if args.json:
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))


if __name__ == "__main__":
    main()
