"""Helpers of the FP8 KV-cache tests: teacher-forced logits against a full-precision run, the
error measure their bounds use, and the swap / copy-on-write scenario."""

from __future__ import annotations

from typing import Any

import numpy as np
from workers_testlib import LocalExecutor, PlanBuilder

from scheduler.sampling_params import SamplingParams


def forced_logits(executor: Any, prompts: list[list[int]], max_tokens: int,
                  forced: dict[int, list[int]] | None = None) -> tuple[dict, dict]:
    """(tokens, logits per step) by sequence id of a greedy run; with `forced`, each sequence
    is fed those tokens (teacher forcing: another run's) instead of its own samples."""
    builder = PlanBuilder(block_size=16, num_gpu_blocks=64, token_budget=24)
    ids = [builder.add(p, SamplingParams(temperature=0), max_tokens=max_tokens)
           for p in prompts]
    if forced is not None:
        original = builder.apply

        def apply(plan, result, logits) -> None:
            result.token_ids = np.array([forced[int(s)][len(builder.seqs[int(s)].outputs)]
                                         for s in result.seq_ids], dtype=np.int64)
            original(plan, result, logits)
        builder.apply = apply
    outputs = builder.run(executor)
    return {i: outputs[i] for i in ids}, {i: np.stack(builder.seqs[i].logits) for i in ids}


def fp8_logits_by_backend(model: str, prompts: list[list[int]], max_tokens: int,
                          forced: dict[int, list[int]]) -> dict[str, dict]:
    """Teacher-forced logits of an FP8-KV worker on the torch kernels and on the Triton
    kernels (the interpreter on CPU), by backend."""
    got = {}
    for backend in ("torch", "triton"):
        executor = LocalExecutor(model=model, num_gpu_blocks=64, max_model_len=512,
                                 kv_cache_dtype="fp8", attention_backend=backend)
        try:
            got[backend] = forced_logits(executor, prompts, max_tokens, forced)[1]
        finally:
            executor.close()
    return got


def step_errors(got: dict, want: dict) -> dict[int, np.ndarray]:
    """Per sequence, each step's max |logit difference| over the reference step's max |logit|."""
    return {s: np.abs(got[s] - ref).max(axis=1) / np.abs(ref).max(axis=1)
            for s, ref in want.items()}


def logit_error(got: dict, want: dict) -> float:
    """The largest of `step_errors`."""
    return max(float(e.max()) for e in step_errors(got, want).values())


def swap_and_fork_tokens(model: str, **config: Any) -> tuple[dict, dict]:
    """Greedy tokens of three prompts (one forked at step 6) without, then with, sequence 0
    swapped out at step 5 and back in at step 7: (plain, moved)."""
    prompts = [list(range(40, 75)), list(range(300, 309)), list(range(600, 621))]

    def scenario(hooks: dict) -> dict[int, list[int]]:
        executor = LocalExecutor(model=model, num_gpu_blocks=64, num_cpu_blocks=8,
                                 max_model_len=512, **config)
        try:
            builder = PlanBuilder(block_size=16, num_gpu_blocks=64, num_cpu_blocks=8,
                                  token_budget=24)
            for p in prompts:
                builder.add(p, SamplingParams(temperature=0), max_tokens=12)
            return builder.run(executor, hooks=hooks)
        finally:
            executor.close()

    plain = scenario({6: lambda b: b.fork(1, seq_index=1)})
    moved = scenario({5: lambda b: b.swap_out(0), 7: lambda b: b.swap_in(0),
                      6: lambda b: b.fork(1, seq_index=1)})
    return plain, moved
