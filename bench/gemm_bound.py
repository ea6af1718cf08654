"""Are the packed bf16 GEMMs of a Qwen3-0.6B decode step at the memory bound? One torch thread.

Times the step's projection GEMMs (28 layers of qkv [4096, 1024], o [1024, 2048], gate_up
[6144, 1024], down [1024, 3072], each its own oneDNN-packed weight, so no cache reuse) at 16
rows, against a plain streaming read (`sum`) of as many bytes, interleaved; medians. A ratio
near 1 says the GEMMs are bound by the weights' memory traffic, not by their arithmetic.

    python bench/gemm_bound.py [--rows 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
LAYERS = 28


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    packed = [[torch.ops.mkldnn._reorder_linear_weight(
        (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16), None) for n, k in SHAPES]
        for _ in range(LAYERS)]
    nbytes = LAYERS * sum(n * k * 2 for n, k in SHAPES)
    plain = torch.ones(nbytes // 4)  # the same bytes, fp32
    xs = {k: torch.randn(args.rows, k, generator=gen).to(torch.bfloat16) for _, k in SHAPES}

    def gemms() -> None:
        for layer in packed:
            for (_, k), w in zip(SHAPES, layer):
                torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")

    times: dict[str, list[float]] = {"gemm": [], "read": []}
    for _ in range(args.rounds):
        for name, fn in (("gemm", gemms), ("read", plain.sum)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    g, r = (statistics.median(times[k]) for k in ("gemm", "read"))
    print(f"weights {nbytes / 1e9:.3f} GB; packed bf16 GEMMs at {args.rows} rows: {g * 1e3:.1f} ms "
          f"({nbytes / g / 1e9:.1f} GB/s); a plain read of as many bytes: {r * 1e3:.1f} ms "
          f"({nbytes / r / 1e9:.1f} GB/s); GEMM / read {g / r:.2f}")


if __name__ == "__main__":
    main()
