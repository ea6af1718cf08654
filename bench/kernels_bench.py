"""Paged-attention kernel benchmark (needs CUDA): decode bandwidth and paged-prefix prefill speed.

Decode: Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim 128, bf16, block size
16) at batch 1/32/256 and contexts 512/4096/32768. Achieved bandwidth = bytes of K/V actually
read (+ q and out) / kernel time, reported as a fraction of this device's measured copy bandwidth
(a large device-to-device `Tensor.copy_`, counting read + write). Target >= 0.7 at batch >= 32,
context >= 4096.

Prefill: one sequence whose last `chunk` tokens are the query and whose first `prefix` tokens
are already in the paged cache (scattered blocks), against torch SDPA (causal, bottom-right
aligned) on contiguous K/V of the same length. Target >= 0.8x SDPA's speed.

    python bench/kernels_bench.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
DTYPE = torch.bfloat16
SEED = 0


def copy_bandwidth(do_bench) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def paged_cache(num_seqs: int, seq_len: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda", generator=gen)
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda", generator=gen)
    # Shuffled block ids: sequences do not read contiguous memory.
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    block_tables = perm.view(num_seqs, blocks_per_seq)
    return k_cache, v_cache, block_tables


def bench_decode(do_bench, batch: int, ctx: int, copy_bw: float) -> dict:
    from kernels.triton_attention import choose_num_segments, paged_attention

    gen = torch.Generator(device="cuda").manual_seed(SEED)
    k_cache, v_cache, block_tables = paged_cache(batch, ctx, gen)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    ms = do_bench(lambda: paged_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                          seq_lens, scale, 1, ctx), warmup=25, rep=100)
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    io_bytes = 2 * q.numel() * q.element_size()
    bw = (kv_bytes + io_bytes) / (ms * 1e-3)
    segments = choose_num_segments(batch, NUM_KV_HEADS, 1, ctx, 64,
                                   torch.cuda.get_device_properties(0).multi_processor_count)
    return {"batch": batch, "ctx": ctx, "ms": ms, "GBps": bw / 1e9, "frac_copy_bw": bw / copy_bw,
            "num_segments": segments}


def bench_prefill(do_bench, prefix: int, chunk: int) -> dict:
    from kernels.triton_attention import paged_attention

    gen = torch.Generator(device="cuda").manual_seed(SEED)
    seq_len = prefix + chunk
    k_cache, v_cache, block_tables = paged_cache(1, seq_len, gen)
    q = torch.randn(chunk, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
    query_start_loc = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    ms_triton = do_bench(lambda: paged_attention(q, k_cache, v_cache, block_tables,
                                                 query_start_loc, seq_lens, scale, chunk,
                                                 seq_len), warmup=25, rep=100)
    # SDPA on the same keys, gathered once into contiguous [1, H, L, D] tensors.
    rows = block_tables[0].long()
    k = k_cache[rows].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len].transpose(0, 1)[None]
    v = v_cache[rows].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len].transpose(0, 1)[None]
    k = k.repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, dim=1).contiguous()
    v = v.repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, dim=1).contiguous()
    qs = q.transpose(0, 1)[None].contiguous()
    visible = torch.ones(chunk, seq_len, dtype=torch.bool, device="cuda").tril(prefix)
    if prefix == 0:
        def sdpa():
            return F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)
    else:
        def sdpa():
            return F.scaled_dot_product_attention(qs, k, v, attn_mask=visible, scale=scale)
    ms_sdpa = do_bench(sdpa, warmup=25, rep=100)
    flops = 4 * NUM_Q_HEADS * HEAD_DIM * chunk * (prefix + (chunk + 1) / 2)
    return {"prefix": prefix, "chunk": chunk, "ms_triton": ms_triton, "ms_sdpa": ms_sdpa,
            "speed_vs_sdpa": ms_sdpa / ms_triton, "triton_TFLOPs": flops / (ms_triton * 1e-3) / 1e12}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this path")
    parser.add_argument("--quick", action="store_true", help="smaller grid, for a smoke run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_bench needs a CUDA GPU (Triton kernels compile for the device); "
              "none is visible here. Run it on a GPU machine.", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    torch.manual_seed(SEED)
    copy_bw = copy_bandwidth(do_bench)
    device = torch.cuda.get_device_name(0)
    print(f"device: {device}   measured copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
    batches = [1, 32] if args.quick else [1, 32, 256]
    contexts = [512, 4096] if args.quick else [512, 4096, 32768]
    decode = []
    print(f"\n{'batch':>6} {'ctx':>6} {'seg':>4} {'ms':>9} {'GB/s':>8} {'frac copy bw':>13}")
    for batch in batches:
        for ctx in contexts:
            row = bench_decode(do_bench, batch, ctx, copy_bw)
            decode.append(row)
            print(f"{batch:>6} {ctx:>6} {row['num_segments']:>4} {row['ms']:>9.4f} "
                  f"{row['GBps']:>8.0f} {row['frac_copy_bw']:>13.2f}")
            torch.cuda.empty_cache()
    prefill = []
    shapes = [(0, 1024), (1024, 512)] if args.quick else [(0, 1024), (0, 4096), (1024, 512),
                                                          (4096, 2048), (8192, 1024)]
    print(f"\n{'prefix':>7} {'chunk':>6} {'triton ms':>10} {'sdpa ms':>9} {'x sdpa':>7} {'TFLOP/s':>8}")
    for prefix, chunk in shapes:
        row = bench_prefill(do_bench, prefix, chunk)
        prefill.append(row)
        print(f"{prefix:>7} {chunk:>6} {row['ms_triton']:>10.4f} {row['ms_sdpa']:>9.4f} "
              f"{row['speed_vs_sdpa']:>7.2f} {row['triton_TFLOPs']:>8.1f}")
    if args.json:
        import triton

        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "triton": triton.__version__,
                       "copy_bandwidth_GBps": copy_bw / 1e9, "decode": decode,
                       "prefill": prefill}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
