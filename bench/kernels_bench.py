"""Kernel benchmark (needs CUDA): decode attention, prefill attention vs SDPA, the fused layer
ops, and the decode step's kernels per layer.

Shapes are Qwen3-0.6B's (hidden 1024, 16 query / 8 KV heads, head_dim 128, 28 layers,
intermediate 3072), bf16, cache block size 16, shuffled block tables; seeds are fixed.

* decode: paged attention at batch 1/32/256 x context 512/4096/32768, timed as a CUDA-graph
  replay (`do_bench_cudagraph`: GPU time, not host launch time). Achieved bandwidth = bytes of
  K/V read (+ q and out) / time, as a fraction of the device's measured copy bandwidth. Then
  every split-K factor forced at batch 32, ctx 1024 (the decode step's shape).
* prefill: one sequence whose last `chunk` tokens are the query and whose first `prefix` tokens
  are already in the paged cache, against torch SDPA on contiguous K/V of the same length
  (causal; with a prefix, a bottom-right-aligned boolean mask). The kernel gets the chunk's own
  K/V rows as the model passes them (views of a QKV projection). Target: >= 1.0x SDPA.
  `--sweep-prefill` also times every tile configuration of the prefill kernel.
* layer ops: the fused attention prologue (q/k RMSNorm + rotary + KV store) against the four
  launches it replaces, residual-add RMSNorm and SiLU-and-mul, at decode and prefill sizes.
* decode step: the whole model's decode forward + LM head + argmax captured in one CUDA graph
  (max_seq_len = --max-model-len, as the worker captures it) at batch 1/32/128/256, context
  1024, profiled with torch.profiler: GPU kernel time per step, kernels per step and per
  layer, and the launches per decoder layer counted at the dispatch point (`LaunchCounter`).

Without CUDA it exits with status 2. The launch counter and the decode-layer builder live in
bench/launch_counter.py (they also run on CPU, under Triton's interpreter).

    python bench/kernels_bench.py [--json out.json] [--quick] [--sweep-prefill]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch_counter import (  # noqa: E402
    BLOCK_SIZE,
    QWEN3_0_6B,
    SEED,
    count_layer_launches,
    decode_metadata,
    model_config,
    randomize_,
)

from workers.distributed import TensorParallelGroup  # noqa: E402
from workers.model_config import ModelConfig  # noqa: E402
from workers.qwen3 import Qwen3ForCausalLM  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
DTYPE = torch.bfloat16
PREFILL_SHAPES = [(0, 1024), (0, 4096), (0, 8192), (1024, 512), (4096, 2048), (8192, 1024),
                  (8192, 8192)]


# ---- GPU benchmarks ----------------------------------------------------------------------------

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


def bench_decode(batch: int, ctx: int, copy_bw: float, num_segments: int | None = None) -> dict:
    from triton.testing import do_bench_cudagraph

    from kernels.attention_split import choose_num_segments, device_sm_count
    from kernels.triton_attention import paged_attention

    gen = torch.Generator(device="cuda").manual_seed(SEED)
    k_cache, v_cache, block_tables = paged_cache(batch, ctx, gen)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    ms = do_bench_cudagraph(lambda: paged_attention(q, k_cache, v_cache, block_tables,
                                                    query_start_loc, seq_lens, scale, 1, ctx,
                                                    num_segments=num_segments))
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    io_bytes = 2 * q.numel() * q.element_size()
    bw = (kv_bytes + io_bytes) / (ms * 1e-3)
    segments = num_segments or choose_num_segments(batch, NUM_KV_HEADS, 1, ctx, 64,
                                                   device_sm_count(q.device))
    return {"batch": batch, "ctx": ctx, "ms": ms, "GBps": bw / 1e9, "frac_copy_bw": bw / copy_bw,
            "num_segments": segments, "forced": num_segments is not None}


def prefill_inputs(prefix: int, chunk: int) -> dict:
    """A paged cache holding prefix + chunk tokens, q, and the chunk's K/V as QKV-output views."""
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    seq_len = prefix + chunk
    k_cache, v_cache, block_tables = paged_cache(1, seq_len, gen)
    q_size, kv_size = NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(chunk, q_size + 2 * kv_size, dtype=DTYPE, device="cuda", generator=gen)
    q = qkv[:, :q_size].view(chunk, NUM_Q_HEADS, HEAD_DIM)
    rows = block_tables[0].long()
    k_all = k_cache[rows].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len]
    v_all = v_cache[rows].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len]
    key = qkv[:, q_size:q_size + kv_size].view(chunk, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, q_size + kv_size:].view(chunk, NUM_KV_HEADS, HEAD_DIM)
    key.copy_(k_all[prefix:])
    value.copy_(v_all[prefix:])
    return dict(q=q, key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                block_tables=block_tables, k_all=k_all, v_all=v_all,
                query_start_loc=torch.tensor([0, chunk], dtype=torch.int32, device="cuda"),
                seq_lens=torch.tensor([seq_len], dtype=torch.int32, device="cuda"))


def bench_prefill(do_bench, prefix: int, chunk: int, sweep: bool) -> dict:
    from kernels.triton_attention import paged_attention

    x = prefill_inputs(prefix, chunk)
    seq_len = prefix + chunk
    scale = HEAD_DIM ** -0.5

    def triton_fn(**tiles):
        return lambda: paged_attention(x["q"], x["k_cache"], x["v_cache"], x["block_tables"],
                                       x["query_start_loc"], x["seq_lens"], scale, chunk, seq_len,
                                       x["key"], x["value"], **tiles)

    ms_triton = do_bench(triton_fn(), warmup=25, rep=100)
    # SDPA on the same keys as contiguous [1, H, L, D] tensors, K/V repeated per query head.
    group = NUM_Q_HEADS // NUM_KV_HEADS
    k = x["k_all"].transpose(0, 1)[None].repeat_interleave(group, dim=1).contiguous()
    v = x["v_all"].transpose(0, 1)[None].repeat_interleave(group, dim=1).contiguous()
    qs = x["q"].transpose(0, 1)[None].contiguous()
    if prefix == 0:
        def sdpa():
            return F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)
    else:
        visible = torch.ones(chunk, seq_len, dtype=torch.bool, device="cuda").tril(prefix)

        def sdpa():
            return F.scaled_dot_product_attention(qs, k, v, attn_mask=visible, scale=scale)
    ms_sdpa = do_bench(sdpa, warmup=25, rep=100)
    err = (triton_fn()().float() - sdpa()[0].transpose(0, 1).float()).abs().max().item()
    flops = 4 * NUM_Q_HEADS * HEAD_DIM * chunk * (prefix + (chunk + 1) / 2)
    row = {"prefix": prefix, "chunk": chunk, "ms_triton": ms_triton, "ms_sdpa": ms_sdpa,
           "speed_vs_sdpa": ms_sdpa / ms_triton, "max_abs_err": err,
           "triton_TFLOPs": flops / (ms_triton * 1e-3) / 1e12}
    if sweep:
        row["sweep"] = []
        for fold in (False, True):
            for block_m in (64, 128):
                for tile_n in (32, 64, 128):
                    for warps in (4, 8):
                        for stages in (2, 3, 4):
                            tiles = dict(fold_gqa=fold, block_m=block_m, tile_n=tile_n,
                                         num_warps=warps, num_stages=stages)
                            try:
                                ms = do_bench(triton_fn(**tiles), warmup=10, rep=50)
                            except Exception as exc:  # out of shared memory, for one
                                print(f"  skipped {tiles}: {type(exc).__name__}")
                                continue
                            row["sweep"].append({**tiles, "ms": ms, "speed_vs_sdpa": ms_sdpa / ms})
        row["sweep"].sort(key=lambda r: r["ms"])
    return row


def bench_layer_ops(tokens: int) -> dict:
    """GPU time (CUDA-graph replay) of the fused layer ops against what they replace."""
    from triton.testing import do_bench_cudagraph

    import kernels
    from kernels import triton_fused

    gen = torch.Generator(device="cuda").manual_seed(SEED)
    hidden, inter = QWEN3_0_6B["hidden_size"], QWEN3_0_6B["intermediate_size"]
    q_size, kv_size = NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(tokens, q_size + 2 * kv_size, dtype=DTYPE, device="cuda", generator=gen)
    w_q = torch.ones(HEAD_DIM, dtype=DTYPE, device="cuda")
    w_k = torch.ones(HEAD_DIM, dtype=DTYPE, device="cuda")
    positions = torch.randint(0, 4096, (tokens,), device="cuda", generator=gen)
    cos_sin = kernels.compute_cos_sin_cache(HEAD_DIM, 4096, 1e6).cuda()
    num_blocks = -(-tokens // BLOCK_SIZE) + 1
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.zeros(cache_shape, dtype=DTYPE, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda", generator=gen)[:tokens]

    def fused():
        kernels.qk_norm_rope_write_kv(qkv, NUM_Q_HEADS, NUM_KV_HEADS, w_q, w_k, 1e-6, positions,
                                      cos_sin, k_cache, v_cache, slots)

    def unfused():  # what the layer launched before: 2 reshape copies, 2 norms, rotary, write
        q = qkv[:, :q_size].reshape(-1, NUM_Q_HEADS, HEAD_DIM)
        k = qkv[:, q_size:q_size + kv_size].reshape(-1, NUM_KV_HEADS, HEAD_DIM)
        v = qkv[:, q_size + kv_size:].view(-1, NUM_KV_HEADS, HEAD_DIM)
        q = kernels.rms_norm(q, w_q, 1e-6)
        k = kernels.rms_norm(k, w_k, 1e-6)
        kernels.rotary_embedding(positions, q, k, cos_sin)
        kernels.write_kv(k, v, k_cache, v_cache, slots)

    x = torch.randn(tokens, hidden, dtype=DTYPE, device="cuda", generator=gen)
    res = torch.randn_like(x)
    w = torch.ones(hidden, dtype=DTYPE, device="cuda")
    gate_up = torch.randn(tokens, 2 * inter, dtype=DTYPE, device="cuda", generator=gen)
    return {
        "tokens": tokens,
        "qk_norm_rope_write_kv_us": 1e3 * do_bench_cudagraph(fused),
        "unfused_prologue_us": 1e3 * do_bench_cudagraph(unfused),
        "add_rms_norm_us": 1e3 * do_bench_cudagraph(lambda: kernels.rms_norm(x, w, 1e-6, res)),
        "torch_add_rms_norm_us": 1e3 * do_bench_cudagraph(
            lambda: kernels.rms_norm(x, w, 1e-6, res, backend="torch")),
        "silu_and_mul_us": 1e3 * do_bench_cudagraph(lambda: triton_fused.silu_and_mul(gate_up)),
        "torch_silu_mul_us": 1e3 * do_bench_cudagraph(
            lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:]),
    }


def bench_decode_step(model: Qwen3ForCausalLM, cfg: ModelConfig, batch: int, ctx: int,
                      num_blocks: int, max_model_len: int) -> dict:
    """One CUDA graph of forward + LM head + argmax; torch.profiler over its replays."""
    from torch.profiler import ProfilerActivity, profile

    positions, md = decode_metadata(batch, ctx, num_blocks, max_model_len, torch.device("cuda"))
    input_ids = torch.randint(100, 150000, (batch,), device="cuda",
                              generator=torch.Generator(device="cuda").manual_seed(SEED))

    def step():
        return model.compute_logits(model(input_ids, positions, md)).argmax(-1)

    with torch.inference_mode():
        step()  # compile and warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        replays = 20
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        event_ms = start.elapsed_time(end) / replays
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
    kernels_us: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and not evt.name.startswith("Memcpy"):
            kernels_us[evt.name[:70]] += evt.time_range.elapsed_us() / replays
            counts[evt.name[:70]] += 1 / replays
    per_step = sum(counts.values())
    layers = cfg.num_hidden_layers
    # Kernels that run at least once per layer, per layer (the embedding, LM head and argmax
    # run once a step; the final norm shares the layers' rms_norm kernel: +1/28).
    per_layer = sum(n for n in counts.values() if n >= layers) / layers
    return {"batch": batch, "ctx": ctx, "graph_ms": event_ms,
            "kernel_ms": sum(kernels_us.values()) / 1e3, "kernels_per_step": per_step,
            "kernels_per_layer": per_layer,
            "top": [(name, round(us, 1), round(counts[name], 2))
                    for name, us in kernels_us.most_common(16)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this path")
    parser.add_argument("--quick", action="store_true", help="smaller grid, for a smoke run")
    parser.add_argument("--sweep-prefill", action="store_true",
                        help="also time every prefill tile configuration (minutes)")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="max_seq_len the decode-step graphs are captured with")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_bench needs a CUDA GPU (Triton kernels compile for the device); "
              "none is visible here. Run it on a GPU machine.", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    torch.manual_seed(SEED)
    copy_bw = copy_bandwidth(do_bench)
    device = torch.cuda.get_device_name(0)
    result: dict = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
                    "copy_bandwidth_GBps": copy_bw / 1e9}
    print(f"device: {device}   measured copy bandwidth: {copy_bw / 1e9:.0f} GB/s")

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)

    shapes = [(0, 1024), (1024, 512), (0, 8192)] if args.quick else PREFILL_SHAPES
    print(f"\nprefill attention vs SDPA\n{'prefix':>7} {'chunk':>6} {'triton ms':>10} "
          f"{'sdpa ms':>9} {'x sdpa':>7} {'TFLOP/s':>8} {'max err':>8}")
    result["prefill"] = []
    for prefix, chunk in shapes:
        row = bench_prefill(do_bench, prefix, chunk, args.sweep_prefill)
        result["prefill"].append(row)
        print(f"{prefix:>7} {chunk:>6} {row['ms_triton']:>10.4f} {row['ms_sdpa']:>9.4f} "
              f"{row['speed_vs_sdpa']:>7.2f} {row['triton_TFLOPs']:>8.1f} "
              f"{row['max_abs_err']:>8.4f}")
        for best in row.get("sweep", [])[:3]:
            print(f"    {best}")
        torch.cuda.empty_cache()
        save()

    print("\nlayer ops, us (CUDA-graph replay)")
    result["layer_ops"] = [bench_layer_ops(t) for t in (1, 32, 256, 8192)]
    for row in result["layer_ops"]:
        print("  " + "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items()))

    cfg = model_config()
    counter = count_layer_launches(cfg, 32, 1024, DTYPE, torch.device("cuda"), "auto",
                                   args.max_model_len)
    result["launches_per_layer_dispatch"] = counter.launches
    print(f"\nlaunches per decoder layer at the dispatch point (batch 32): "
          f"{len(counter.launches)}: {counter.launches}")

    step_batches = [1, 32] if args.quick else [1, 32, 128, 256]
    ctx = 1024
    per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = max(step_batches) * per_seq + 1
    model = Qwen3ForCausalLM(cfg, TensorParallelGroup.single(), DTYPE, "auto",
                             args.max_model_len).cuda()
    randomize_(model, SEED)
    from workers.cache_engine import CacheEngine

    cache = CacheEngine(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, BLOCK_SIZE,
                        num_blocks, 0, DTYPE, torch.device("cuda"))
    cache.bind(model.attention_layers())
    print(f"\ndecode step (forward + LM head + argmax in one CUDA graph), ctx {ctx}, "
          f"captured with max_seq_len {args.max_model_len}\n{'batch':>6} {'graph ms':>9} "
          f"{'kernel ms':>10} {'kernels/step':>13} {'per layer':>10}")
    result["decode_step"] = []
    for batch in step_batches:
        row = bench_decode_step(model, cfg, batch, ctx, num_blocks, args.max_model_len)
        result["decode_step"].append(row)
        print(f"{batch:>6} {row['graph_ms']:>9.3f} {row['kernel_ms']:>10.3f} "
              f"{row['kernels_per_step']:>13.1f} {row['kernels_per_layer']:>10.2f}")
        for name, us, n in row["top"][:8]:
            print(f"        {us:>8.1f} us  x{n:<6} {name}")
        save()  # (each row as it comes: a time budget that ends the run keeps it)
    # Decode attention last: a fault at one shape (a CUDA error ends the process) keeps the
    # sections above, and the rows before it, in the JSON.
    batches = [1, 32] if args.quick else [1, 32, 256]
    contexts = [512, 4096] if args.quick else [512, 4096, 32768]
    print(f"\ndecode attention (CUDA-graph replay)\n{'batch':>6} {'ctx':>6} {'seg':>4} "
          f"{'us':>9} {'GB/s':>8} {'frac copy bw':>13}")
    result["decode"] = []
    for batch in batches:
        for ctx in contexts:
            row = bench_decode(batch, ctx, copy_bw)
            result["decode"].append(row)
            print(f"{batch:>6} {ctx:>6} {row['num_segments']:>4} {1e3 * row['ms']:>9.1f} "
                  f"{row['GBps']:>8.0f} {row['frac_copy_bw']:>13.2f}")
            torch.cuda.empty_cache()
            save()
    # Split-K at the decode step's own shape (batch 32, ctx 1024: 0.71 of the copy bandwidth on
    # the 2026-11-27 H100, the step's largest gap): every factor forced, against the table's
    # pick above, for the next revision of triton_attention's _MEASURED_BEST_SEGMENTS.
    print(f"\ndecode attention split-K sweep, batch 32, ctx 1024\n{'seg':>4} {'us':>9} "
          f"{'frac copy bw':>13}")
    result["decode_split_sweep"] = []
    for segments in (1, 2, 4, 8, 16):
        row = bench_decode(32, 1024, copy_bw, num_segments=segments)
        result["decode_split_sweep"].append(row)
        print(f"{segments:>4} {1e3 * row['ms']:>9.1f} {row['frac_copy_bw']:>13.2f}")
        save()

    return 0


if __name__ == "__main__":
    sys.exit(main())
