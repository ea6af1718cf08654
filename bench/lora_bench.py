"""What LoRA costs: the batched kernels against the base layer they ride on (kernel mode), and
the engine's decode step with 0 / 1 / 4 / 16 distinct adapters against the base model alone
(`--engine`, the issue's measure).

Kernel mode: a Qwen3-8B-like packed QKV projection (hidden 4096, q 4096 + k 1024 + v 1024
outputs), the cost one adapted layer adds.

Rows per token count T (a decode batch of T sequences, or a prefill chunk of T tokens):

* base: the layer's own GEMM, `x @ W^T` ([T, 4096] x [6144, 4096]);
* twin / triton: `kernels.lora_shrink` + `lora_expand` with --slots adapters resident (plus
  the zero slot), rank --rank per slice (3 slices: width 3 R), every token in a random slot
  (seeded); twin is the torch reference, triton the Triton kernels (CUDA only).

CPU: median of --runs wall-clock runs, fp32. CUDA: Triton's do_bench_cudagraph (as decode
steps replay them), bf16.

Engine mode: --batch prompts of --prompt-len random tokens (seeded), greedy, --max-tokens
each, all prefilled in one step, then decoded together: the decode step time is the median
wall time of the steps after the prefill, then the median over --rounds rounds that run every
case in turn. Rows, same prompts, same run, both engines built once: `base` (enable_lora off); LoRA on (max_loras 16, max_lora_rank --rank) with 0 adapters
in the batch, then 1, 4 and 16 distinct adapters, requests dealt round-robin. Adapters are
written in PEFT's format with random A and B (seeded), rank --rank on all seven modules.
Default model: a random Qwen3-0.6B (bench/throughput.py's `qwen3-0.6b-random`).

    python bench/lora_bench.py [--device cpu|cuda] [--tokens 1 32 256] [--slots 4] [--json out]
    python bench/lora_bench.py --engine [--model qwen3-0.6b-random] [--batch 32] [--json out]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_bench import _time as time_ms  # noqa: E402  (CUDA: replayed as a CUDA graph)

import kernels  # noqa: E402

HIDDEN, OUT = 4096, 4096 + 2 * 1024


def _kernel_row(t: int, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: int,
                device: str, runs: int, g: torch.Generator) -> dict:
    x = torch.randn(t, HIDDEN, generator=g).to(device, w.dtype)
    token_slots = torch.randint(0, slots, (t,), generator=g).to(device)
    out = torch.empty(t, OUT, device=device, dtype=w.dtype)

    def lora(backend: str) -> None:
        y = kernels.lora_shrink(x, a, token_slots, backend=backend)
        kernels.lora_expand(y, b, token_slots, out, backend=backend)

    row = {"tokens": t, "base_s": time_ms(lambda: torch.matmul(x, w.T, out=out), device, runs),
           "twin_s": time_ms(lambda: lora("torch"), device, runs)}
    if device == "cuda":
        row["triton_s"] = time_ms(lambda: lora("triton"), device, runs)
    return {k: v / 1e3 if k != "tokens" else v for k, v in row.items()}


def bench(device: str, tokens: list[int], slots: int, rank: int, runs: int) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    width = 3 * rank
    w = (torch.randn(OUT, HIDDEN, generator=g) * 0.02).to(device, dtype)
    a = (torch.randn(slots + 1, width, HIDDEN, generator=g) * 0.02).to(device, dtype)
    b = (torch.randn(slots + 1, OUT, width, generator=g) * 0.02).to(device, dtype)
    return [_kernel_row(t, w, a, b, slots, device, runs, g) for t in tokens]


def write_adapter(target: Path, model_path: str, rank: int, seed: int) -> str:
    """A PEFT-format adapter of the model: random A and B on all seven modules."""
    from safetensors.torch import save_file

    from cluster.engine.lora import LORA_MODULES, module_shapes
    from workers.model_config import load_model_config

    mc = load_model_config(model_path, 1)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, module in itertools.product(range(mc.num_hidden_layers), LORA_MODULES):
        n_in, n_out = module_shapes(mc)[module]
        part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        name = f"base_model.model.model.layers.{layer}.{part}.{module}"
        tensors[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.02
        tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.02
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / "adapter_model.safetensors"))
    (target / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
         "target_modules": list(LORA_MODULES)}))
    return str(target)


def _decode_step(llm, prompts: list[list[int]], loras: list, max_tokens: int) -> dict:
    """Median decode step seconds and output tokens/s of one batch."""
    from cluster import SamplingParams

    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{id(loras)}-{i}", p, sp,
                           lora_request=loras[i % len(loras)] if loras else None)
    steps, start = [], time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    return {"decode_step_s": statistics.median(steps[1:]),
            "tok_s": len(prompts) * max_tokens / total}


def bench_engine(args: argparse.Namespace) -> list[dict]:
    from throughput import model_path

    from cluster import LLM, LoRARequest

    path = model_path(args.model)
    rng = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 150000, (args.batch, args.prompt_len), generator=rng).tolist()
    # (a fixed KV pool: on CPU 16 slots of a 0.6B model take most of the 1 GiB KV budget)
    blocks = args.batch * -(-(args.prompt_len + args.max_tokens) // 16) + 16
    common = dict(device=args.device, max_num_seqs=max(args.batch, 32), max_model_len=512,
                  enable_prefix_caching=False, num_gpu_blocks_override=blocks)
    cases: dict[str, list[dict]] = {}
    engines = [lambda: LLM(path, **common),
               lambda: LLM(path, enable_lora=True, max_loras=16, max_lora_rank=args.rank, **common)]
    if args.lora_first:  # (construction order: to tell an order effect from LoRA's cost)
        engines.reverse()
    with tempfile.TemporaryDirectory() as tmp, engines[0]() as first, engines[1]() as second:
        base, llm = (second, first) if args.lora_first else (first, second)
        adapters = [LoRARequest(f"a{i}", i + 1, write_adapter(Path(tmp) / f"a{i}", path,
                                                               args.rank, i)) for i in range(16)]
        _decode_step(base, prompts[:2], [], 4)  # (warm-up)
        _decode_step(llm, prompts[:2], adapters[:1], 4)
        for _ in range(args.rounds):  # interleaved: the VM's speed drifts
            cases.setdefault("base", []).append(
                _decode_step(base, prompts, [], args.max_tokens))
            for n in args.adapters:
                cases.setdefault(f"{n} adapters", []).append(
                    _decode_step(llm, prompts, adapters[:n], args.max_tokens))
    rows = [{"case": case, "runs": len(runs),
             **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
            for case, runs in cases.items()]
    for row in rows:
        row["vs_base"] = row["decode_step_s"] / rows[0]["decode_step_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--model", default="qwen3-0.6b-random")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16],
                        help="distinct adapters in the batch, one case each (<= 16)")
    parser.add_argument("--lora-first", action="store_true",
                        help="build the LoRA engine before the base one")
    args = parser.parse_args()
    if args.engine:
        rows = bench_engine(args)
        print(f"engine, {args.model} on {args.device}; batch {args.batch}, rank {args.rank}")
        print(f"{'case':>12} {'decode step ms':>15} {'vs base':>8} {'tok/s':>8}")
        for r in rows:
            print(f"{r['case']:>12} {r['decode_step_s'] * 1e3:>15.1f} {r['vs_base']:>8.2f} "
                  f"{r['tok_s']:>8.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "device": args.device, "rows": rows}, f, indent=1)
        return
    rows = bench(args.device, args.tokens, args.slots, args.rank, args.runs)
    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
    print(f"device {args.device} ({name}); slots {args.slots}, rank {args.rank} x 3 slices")
    print(f"{'T':>6} {'base us':>10} {'twin us':>10} {'twin/base':>10} {'triton us':>10} "
          f"{'triton/base':>12}")
    for r in rows:
        base, tri = r["base_s"], r.get("triton_s")
        tri_us = "-" if tri is None else f"{tri * 1e6:.1f}"
        tri_ratio = "-" if tri is None else f"{tri / base:.2f}"
        print(f"{r['tokens']:>6} {base * 1e6:>10.1f} {r['twin_s'] * 1e6:>10.1f} "
              f"{r['twin_s'] / base:>10.2f} {tri_us:>10} {tri_ratio:>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "name": name, "slots": args.slots,
                       "rank": args.rank, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
