"""Offline throughput: this engine vs Hugging Face transformers on one machine, one workload.

Workloads are BENCHMARKS.md's: `offline-cpu` (qwen3-tiny, fp32, 64 requests, prompts 32-256,
outputs 32-128, ignore_eos, greedy) and `offline-gpu` (Qwen3-0.6B config with random weights,
bf16, 256 requests, prompts 100-1024, outputs 100-1024, ignore_eos, temperature 0.6).
Throughput = output tokens / wall seconds for the whole batch, prefill included.

    .venv/bin/python bench/throughput.py --workload offline-cpu [--tp 1 2] [--json out.json]
        [--compare-async]  # engine rows with async scheduling on and off
        [--seeds on|off|both]  # a seed per request (default on), none (nano-vllm's way), both
        [--passes 2]  # time the workload this many times in one engine: the first run after
                      # start-up and the warmed ones (the row's tok/s is the last one's)
        [--hf-subset 32] [--hf-continuous-only]  # fewer transformers runs (slow on a GPU)
        [--skip-engine]  # the transformers rows alone (the GPU report runs them last)
`--json` is rewritten after every system's run, so a run cut short keeps the rows it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORKLOADS = {
    "offline-cpu": dict(model="qwen3-tiny", n=64, prompt=(32, 256), output=(32, 128),
                        temperature=0.0),
    "offline-gpu": dict(model="qwen3-0.6b-random", n=256, prompt=(100, 1024),
                        output=(100, 1024), temperature=0.6),
}


def make_requests(w: dict[str, Any], seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(w["n"]):
        plen = rng.randint(*w["prompt"])
        olen = rng.randint(*w["output"])
        reqs.append(([rng.randrange(100, 150000) for _ in range(plen)], olen))
    return reqs


def fresh_prompts(reqs: list[tuple[list[int], int]], k: int) -> list[tuple[list[int], int]]:
    """The workload with the same prompt and output lengths and other token ids (`k` > 0: each
    id moved k * 49,999 places around make_requests' range): the prefix cache has none of
    another k's blocks, so a second timed pass measures the warmed engine, not its cache hits
    (on the 2026-11-27 H100 pass 2 re-sent pass 1's prompts, every block of them still cached)."""
    lo, span = 100, 150000 - 100
    return [([lo + (t - lo + k * 49999) % span for t in p], o) for p, o in reqs]


def model_path(name: str) -> str:
    from workers.tiny_model import QWEN3_0_6B_CONFIG, cache_root, resolve_model, write_random_qwen3

    if name == "qwen3-0.6b-random":
        target = cache_root() / "qwen3-0.6b-random"
        if not (target / "model.safetensors").is_file():
            write_random_qwen3(target, QWEN3_0_6B_CONFIG, seed=0)
        return str(target)
    return resolve_model(name)


def run_engine(path: str, reqs: list, temperature: float, tp: int,
               async_scheduling: bool | None = None, seeds: tuple[bool, ...] = (True,),
               passes: int = 1, **engine_args: Any) -> dict[str, float]:
    """The workload through `LLM.generate` in one engine: for each of `seeds` (a seed per
    request or none), `passes` timed runs; the first right after start-up and one tiny
    warm-up request. The row's figures are the last run's; every run's tok/s is listed."""
    from cluster import LLM, SamplingParams

    compiles = _CompileLog()
    llm = LLM(path, tensor_parallel_size=tp, worker_num_cpus=max(0.5, 2 / tp) if tp > 1 else 1.0,
              seed=0, async_scheduling=async_scheduling, **engine_args)
    try:
        # every timed pass (and this warm-up) sends prompts of its own: see fresh_prompts
        warm = [{"prompt_token_ids": fresh_prompts(reqs[:1], len(seeds) * passes)[0][0]}]
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        per_pass: dict[str, list[float]] = {}
        sent = 0  # timed passes so far
        for seeded in seeds:
            params = [SamplingParams(temperature=temperature, max_tokens=o, ignore_eos=True,
                                     seed=i if seeded else None) for i, (_, o) in enumerate(reqs)]
            for _ in range(passes):
                run = fresh_prompts(reqs, sent) if sent else reqs  # the first: the workload
                sent += 1
                eng = llm.engine
                eng.num_steps = 0
                eng.forward_seconds = eng.step_seconds = 0.0
                compiles.events.clear()
                start = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": p} for p, _ in run], params,
                                    use_tqdm=False)
                wall = time.perf_counter() - start
                compiled = compiles.summary()
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                assert tokens == sum(o for _, o in reqs)
                per_pass.setdefault("seeded" if seeded else "no seeds", []).append(
                    round(tokens / wall, 1))
                print(f"engine async={async_scheduling} seeded={seeded} pass "
                      f"{len(per_pass['seeded' if seeded else 'no seeds'])}: "
                      f"{tokens / wall:.1f} tok/s; Triton compiles in the pass: {compiled}",
                      flush=True)  # printed now: survives a step's timeout
        return {"tok_per_s": tokens / wall, "wall_s": wall, "tokens": tokens,
                "steps": eng.num_steps,
                "overhead_ms_per_step": 1000 * (eng.step_seconds - eng.forward_seconds)
                / max(1, eng.num_steps),
                "overhead_fraction": eng.overhead_fraction(),
                "passes_tok_per_s": per_pass}
    finally:
        compiles.close()
        llm.shutdown()


class _CompileLog:
    """Triton JIT compilations while it is open (CUDA only): a timed run that compiles kernels
    pays for them, so the first run after start-up says which shapes the warm-up missed."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []
        self._started: dict[str, float] = {}
        try:
            from triton import knobs
        except ImportError:
            self._knobs = None
            return
        self._knobs = knobs.runtime
        self._knobs.jit_cache_hook = self._before
        self._knobs.jit_post_compile_hook = self._after

    def _before(self, *args, **kw) -> None:  # noqa: ANN002, ANN003 — Triton's hook signature
        self._started[kw.get("repr", "?")] = time.perf_counter()
        return None

    def _after(self, *args, **kw) -> None:  # noqa: ANN002, ANN003
        name = kw.get("repr", "?")
        self.events.append((name, time.perf_counter() - self._started.pop(name, time.perf_counter())))
        return None

    def summary(self) -> str:
        if not self.events:
            return "none"
        secs = sum(t for _, t in self.events)
        return f"{len(self.events)} ({secs:.1f} s): " + "; ".join(
            f"{n[:400]} {t:.2f}s" for n, t in self.events)

    def close(self) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook = self._knobs.jit_post_compile_hook = None


def run_hf_generate(path: str, reqs: list, temperature: float, batch: int,
                    device: str) -> dict[str, float]:
    """transformers `generate`, static batches with left padding; counts requested tokens only."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    pad = model.generation_config.pad_token_id or 0
    start = time.perf_counter()
    tokens = 0
    with torch.no_grad():
        for i in range(0, len(reqs), batch):
            chunk = reqs[i:i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk],
                                device=device)
            new = max(o for _, o in chunk)
            kw = (dict(do_sample=True, temperature=temperature) if temperature > 0
                  else dict(do_sample=False))
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           pad_token_id=pad, **kw)
            tokens += sum(o for _, o in chunk)
    wall = time.perf_counter() - start
    return {"tok_per_s": tokens / wall, "wall_s": wall, "tokens": tokens, "batch": batch}


def run_hf_generate_batch(path: str, reqs: list, temperature: float,
                          device: str) -> dict[str, float]:
    """transformers' continuous batching (`generate_batch`): one max_new_tokens for all, so
    every request generates the workload's largest output; all its tokens are counted."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    new = max(o for _, o in reqs)
    cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, eos_token_id=-1,
                           do_sample=temperature > 0, temperature=temperature or None)
    start = time.perf_counter()
    with torch.no_grad():
        outs = model.generate_batch([p for p, _ in reqs], generation_config=cfg)
    wall = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    return {"tok_per_s": tokens / wall, "wall_s": wall, "tokens": tokens}


def run_hf_continuous_exact(path: str, reqs: list, temperature: float,
                            device: str) -> dict[str, float]:
    """transformers' continuous batching with each request's own output length (the same
    workload the engine runs): generate_batch's manager, fed through add_request with a
    per-request max_new_tokens."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    cfg = GenerationConfig(max_new_tokens=max(o for _, o in reqs), eos_token_id=-1,
                           do_sample=temperature > 0, temperature=temperature or None)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p, _ in reqs),
                          max_generated_length=max(o for _, o in reqs), num_requests=len(reqs))
    start = time.perf_counter()
    tokens = 0
    with torch.no_grad(), model.continuous_batching_context_manager(
            generation_config=cfg, block=True, timeout=5, workload_hints=hints) as manager:
        for p, o in reqs:
            manager.add_request(p, max_new_tokens=o)
        done = 0
        while done < len(reqs):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                tokens += len(result.generated_tokens)
                done += 1
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early")
    wall = time.perf_counter() - start
    expected = sum(o for _, o in reqs)
    if tokens != expected:
        raise RuntimeError(f"continuous batching generated {tokens} tokens, expected {expected}")
    return {"tok_per_s": tokens / wall, "wall_s": wall, "tokens": tokens}


def machine() -> dict[str, str]:
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": str(torch.get_num_threads())}
    try:
        cpu = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
               if line.startswith("model name")]
        info["cpu"] = f"{cpu[0]} x{len(cpu)}"
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="offline-cpu")
    ap.add_argument("--tp", type=int, nargs="+", default=[1])
    ap.add_argument("--runs", type=int, default=3, help="median of this many runs")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-engine", action="store_true",
                    help="no engine rows: the transformers peers alone")
    ap.add_argument("--compare-async", action="store_true",
                    help="engine rows with async_scheduling on and off (else the default, auto)")
    ap.add_argument("--seeds", choices=["on", "off", "both"], default="on",
                    help="a seed per request (on), none (off), or rows for both")
    ap.add_argument("--passes", type=int, default=1,
                    help="time the workload this many times in each engine")
    ap.add_argument("--hf-continuous-only", action="store_true",
                    help="of the transformers peers, only continuous batching (exact lengths)")
    ap.add_argument("--hf-subset", type=int, default=0,
                    help="run the transformers peers on the first N requests only (0: all)")
    ap.add_argument("--quantization", default=None, choices=[None, "fp8"],
                    help="the engine's weights: fp8 quantizes them at load (FP8 W8A8)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    engine_args = {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    w = WORKLOADS[args.workload]
    reqs = make_requests(w)
    hf_reqs = reqs[:args.hf_subset] if args.hf_subset else reqs
    path = model_path(w["model"])
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows: dict[str, dict[str, float]] = {}

    seeds = {"on": (True,), "off": (False,), "both": (True, False)}[args.seeds]
    modes = [True, False] if args.compare_async else [None]
    systems: list[tuple[str, Any, tuple]] = [
        (f"engine tp={tp}" + ("" if on is None else f", async {'on' if on else 'off'}"),
         partial(run_engine, **engine_args), (path, reqs, w["temperature"], tp, on, seeds,
                                              args.passes))
        for tp in args.tp for on in modes if not args.skip_engine]
    if args.hf_continuous_only:
        systems.append(("hf continuous, exact lengths", run_hf_continuous_exact,
                        (path, hf_reqs, w["temperature"], device)))
    elif not args.skip_hf and not args.skip_engine:
        # generate_batch gives every request the longest output: the engine on that workload too
        longest = [(p, max(o for _, o in reqs)) for p, _ in reqs]
        systems += [
            ("engine tp=1, all outputs longest", run_engine, (path, longest, w["temperature"], 1)),
            (f"hf generate (batch {args.hf_batch})", run_hf_generate,
             (path, hf_reqs, w["temperature"], args.hf_batch, device)),
            ("hf generate_batch", run_hf_generate_batch,
             (path, hf_reqs, w["temperature"], device)),
            ("hf continuous, exact lengths", run_hf_continuous_exact,
             (path, hf_reqs, w["temperature"], device)),
        ]
    # Round-robin, so a machine whose speed drifts over the run treats every system alike.
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in systems}
    for _ in range(args.runs):
        for name, fn, fn_args in systems:
            if runs[name] and "error" in runs[name][0]:
                continue
            try:
                runs[name].append(fn(*fn_args))
            except Exception as e:  # noqa: BLE001 — report, don't hide, a peer that fails here
                if name.startswith("engine"):
                    raise
                runs[name] = [{"error": f"{type(e).__name__}: {e}"[:200]}]
            rows = _rows(runs)
            if args.json:  # (after every run: a time budget that ends the rest keeps these)
                _write_json(args.json, args.workload, engine_args, rows)
    print(f"workload {args.workload}: {len(reqs)} requests, "
          f"{sum(o for _, o in reqs)} output tokens"
          + (f" (transformers: the first {len(hf_reqs)})" if args.hf_subset else "")
          + f"; {machine()}")
    print(f"{'system':32} {'tok/s':>9} {'wall s':>8} {'overhead ms/step':>17} {'overhead %':>11}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:32} {r['error']}")
            continue
        ov = r.get("overhead_ms_per_step")
        frac = r.get("overhead_fraction")
        print(f"{name:32} {r['tok_per_s']:9.1f} {r['wall_s']:8.2f} "
              f"{'' if ov is None else f'{ov:.2f}':>17} "
              f"{'' if frac is None else f'{100 * frac:.1f}':>11}")
    if args.json:
        _write_json(args.json, args.workload, engine_args, rows)


def _rows(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each system's row: its median run, with every run's tok/s (or its error)."""
    rows: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        if not rs:
            continue
        if "error" in rs[0]:
            rows[name] = rs[0]
            continue
        best = dict(sorted(rs, key=lambda r: r["tok_per_s"])[len(rs) // 2])
        best["runs_tok_per_s"] = [round(r["tok_per_s"], 1) for r in rs]
        rows[name] = best
    return rows


def _write_json(path: Path, workload: str, engine_args: dict[str, Any],
                rows: dict[str, dict[str, Any]]) -> None:
    path.write_text(json.dumps({"workload": workload, "machine": machine(), **engine_args,
                                "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
