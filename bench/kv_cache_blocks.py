"""KV blocks and sequences that fit the same memory, FP8 KV cache (kv_cache_dtype fp8)
against the model's bf16, as each worker sizes its cache.

For each kv_cache_dtype a bf16 worker of the model is built on CPU and asked for its block
count (Worker.determine_num_blocks: the CPU budget of workers/worker.py CPU_KV_CACHE_BYTES,
swap_space, kv_offloading_size), with max_num_seqs large enough that the memory, not the
sequence count, is the limit. Prints block bytes, GPU-pool / swap / offload-tier blocks and
how many max_model_len-token sequences the pool holds, and the FP8/bf16 ratios.

    .venv/bin/python bench/kv_cache_blocks.py [--model qwen3-tiny] [--max-model-len 4096]
        [--swap-space 1] [--offload-gib 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
from typing import Any

from workers.config import WorkerConfig
from workers.tiny_model import resolve_model
from workers.worker import Worker


def measure(model: str, kv_cache_dtype: str, max_model_len: int, swap_space: float,
            offload_gib: float) -> dict[str, Any]:
    worker = Worker(WorkerConfig(model=resolve_model(model), dtype="bfloat16",
                                 kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
                                 max_num_seqs=1 << 20, swap_space=swap_space,
                                 kv_offloading_size=offload_gib))
    worker.init_distributed()
    worker.load_model()
    gpu, cpu, tier = worker.determine_num_blocks()
    block = worker.kv_block_bytes()
    per_seq = -(-max_model_len // worker.config.block_size)
    return {"kv_cache_dtype": kv_cache_dtype, "block_bytes": block, "gpu_blocks": gpu,
            "swap_blocks": cpu, "offload_blocks": tier, "sequences": gpu // per_seq}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-tiny")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--swap-space", type=float, default=1.0)
    ap.add_argument("--offload-gib", type=float, default=1.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = [measure(args.model, kv, args.max_model_len, args.swap_space, args.offload_gib)
            for kv in ("auto", "fp8")]
    keys = ("block_bytes", "gpu_blocks", "swap_blocks", "offload_blocks", "sequences")
    print(f"model {args.model}, bf16 weights, max_model_len {args.max_model_len}, "
          f"machine {platform.processor() or platform.machine()}")
    print("| kv_cache_dtype | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for r in rows:
        print(f"| {'bf16 (auto)' if r['kv_cache_dtype'] == 'auto' else 'fp8'} | "
              + " | ".join(str(r[k]) for k in keys) + " |")
    ratios = {k: rows[1][k] / rows[0][k] for k in keys}
    print("| fp8 / bf16 | " + " | ".join(f"{ratios[k]:.2f}x" for k in keys) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "ratios": ratios}, f, indent=2)


if __name__ == "__main__":
    main()
