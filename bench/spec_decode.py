"""Speculative decoding's mechanics on one engine: tok/s with it on over tok/s with it off.

Random-weight models do not agree with one another, so acceptance is set, not found: the
`ReplayProposer` (benchmark-only, not a product feature) replays a recorded greedy run of the
same prompt and proposes its true next tokens, each kept with probability `acceptance` and
made wrong otherwise. Rows:
  acceptance 1.0, batch 1   every proposal right (k + 1 tokens per LM-head read)
  acceptance 0.0, batch 1   every proposal wrong (the per-sequence off switch must limit it)
  acceptance 0.7, batch 32  a loaded batch
  ngram, batch 1            vLLM's n-gram lookup on prompts with repeated motifs
  draft, batch 1            a draft model of the target's shapes with 2 layers and other
                            random weights (`draft_model`: `qwen3-tiny-draft` for qwen3-tiny):
                            proposals rarely right; the off switch must limit it
  selfdraft, batch 1        qwen3-tiny drafting for itself: every proposal right, but the
                            draft costs what the target does (on CPU the 152k-row LM head
                            dominates both), so this row measures the draft path's overhead
Each row times off and on alternately (`--repeats` times each, medians), engines built once in
this process and warmed up first, greedy, ignore_eos; tok/s is output tokens over wall time (prefill included,
prompts are short). Acceptance length = 1 + accepted / drafts (tokens per verify row).

    .venv/bin/python bench/spec_decode.py [--k 4] [--tokens 256] [--batch-tokens 64]
        [--repeats 2] [--rows 1.0:1,0.0:1,0.7:32,ngram:1,draft:1,selfdraft:1] [--json out.json]
        [--disable-by-batch-size N] [--device cuda --model DIR [--draft-model DIR]]
        [--enforce-eager]

On a GPU the engines replay CUDA graphs for decode and verify steps (workers/cuda_graph.py);
`--enforce-eager` turns them off in both engines, so the verify graphs' gain is the ratio of
the `tok_s_on` of two runs, one with the flag and one without (same rows, same machine).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class ReplayProposer:
    """Benchmark-only: the recorded greedy continuation, each token right with probability p."""

    def __init__(self, recorded: dict[tuple[int, ...], list[int]], p: float, seed: int = 0) -> None:
        self.recorded = recorded
        self.p = p
        self.rng = random.Random(seed)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        full = self.recorded[tuple(token_ids[:16])]
        true = full[len(token_ids):len(token_ids) + k]
        return [t if self.rng.random() < self.p else (t + 1) % 150000 for t in true]


def draft_model(target: str) -> str:
    """The `draft` row's draft for `target` (a name or checkpoint directory): a draft's KV
    shares the target's cache blocks, so its KV layout must be the target's
    (workers/draft_runner.check_draft_fits). `qwen3-tiny-draft` where it fits, else a random
    dense Qwen3 of the target's shapes with 2 layers (seed 1, as qwen3-tiny-draft is made from
    qwen3-tiny), written into the model cache on first use under a name that hashes its
    config, so a later run (or gpu_report's models step, which writes it ahead) reuses it."""
    from workers.draft_runner import check_draft_fits
    from workers.model_config import load_model_config
    from workers.tiny_model import (
        TINY_DRAFT_MODEL_NAME,
        TINY_DRAFT_SEED,
        cache_root,
        resolve_model,
        write_random_qwen3,
    )

    want = load_model_config(resolve_model(target))
    tiny = resolve_model(TINY_DRAFT_MODEL_NAME)
    with contextlib.suppress(ValueError):  # else a draft of the target's shapes, below
        check_draft_fits(want, load_model_config(tiny), 1)
        return tiny
    config = {name: getattr(want, name) for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
        "rope_theta", "tie_word_embeddings", "dtype")}
    config["num_hidden_layers"] = 2
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_root() / f"qwen3-random-draft-{digest}"
    if not (path / "model.safetensors").is_file():
        write_random_qwen3(path, config, seed=TINY_DRAFT_SEED)
    check_draft_fits(want, load_model_config(path), 1)
    return str(path)


def _prompts(batch: int, motif: bool, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(batch):
        if motif:
            m = [rng.randrange(100, 150000) for _ in range(6)]
            out.append((m * 6)[:32])
        else:
            out.append([rng.randrange(100, 150000) for _ in range(32)])
    return out


def _timed(llm, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    from scheduler import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    seconds = time.perf_counter() - start
    return len(prompts) * tokens / seconds, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per request, batch 1")
    ap.add_argument("--batch-tokens", type=int, default=64, help="output tokens, batch > 1")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rows", default="1.0:1,0.0:1,0.7:32,ngram:1,draft:1,selfdraft:1")
    ap.add_argument("--json", default=None)
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="speculative_config.disable_by_batch_size (default: the engine's)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default="qwen3-tiny", help="the target (checkpoint dir or name)")
    ap.add_argument("--draft-model", default=None,
                    help="the `draft` row's draft (default: draft_model(--model))")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no CUDA graphs (decode nor verify): the A/B for the verify graphs")
    a = ap.parse_args()

    from cluster import LLM

    kinds = {item.split(":")[0] for item in a.rows.split(",")}
    draft_models = {"draft": a.draft_model, "selfdraft": a.model}
    if "draft" in kinds and a.draft_model is None:
        draft_models["draft"] = draft_model(a.model)
    engine = dict(model=a.model, device=a.device, executor="inprocess", max_num_seqs=64,
                  max_model_len=1024, enforce_eager=a.enforce_eager)
    if a.device == "cuda":  # every engine lives at once: each takes its share of the GPU
        engine["gpu_memory_utilization"] = 0.9 / (2 + len(kinds & set(draft_models)))
    off = LLM(**engine)
    on = LLM(**engine, speculative_config={"method": "ngram", "num_speculative_tokens": a.k,
                                           "disable_by_batch_size": a.disable_by_batch_size})
    ngram = on.engine.scheduler.spec.proposer
    ons = {kind: LLM(**engine, speculative_config={
        "model": draft_models[kind], "num_speculative_tokens": a.k,
        "disable_by_batch_size": a.disable_by_batch_size})
           for kind in draft_models if kind in kinds}
    for llm in (off, on, *ons.values()):  # warm up (first-call costs; verify rows when on)
        _timed(llm, _prompts(1, True, seed=99), 32)
    rows = []
    for item in a.rows.split(","):
        acc, batch = item.split(":")
        batch = int(batch)
        llm_on = ons.get(acc, on)
        spec = llm_on.engine.scheduler.spec
        tokens = a.tokens if batch == 1 else a.batch_tokens
        prompts = _prompts(batch, acc == "ngram", seed=batch)
        offs, ons_tps = [], []
        recorded = None
        drafts0, draft_tok0, acc0 = spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens
        for r in range(a.repeats):
            tps, outs = _timed(off, prompts, tokens)
            offs.append(tps)
            if recorded is None:
                recorded = {tuple(p[:16]): p + o for p, o in zip(prompts, outs)}
                if acc not in draft_models:
                    spec.proposer = (ngram if acc == "ngram"
                                     else ReplayProposer(recorded, float(acc), r))
            tps, outs_on = _timed(llm_on, prompts, tokens)
            assert outs_on == outs, "speculation changed greedy tokens"
            ons_tps.append(tps)
        drafts = spec.num_drafts - drafts0
        accepted = spec.num_accepted_tokens - acc0
        row = {"acceptance": acc if acc in ("ngram", *draft_models) else float(acc), "batch": batch,
               "k": a.k, "output_tokens": tokens, "device": a.device,
               "cuda_graphs": a.device == "cuda" and not a.enforce_eager,
               "tok_s_off": round(statistics.median(offs), 2),
               "tok_s_on": round(statistics.median(ons_tps), 2),
               "speedup": round(statistics.median(ons_tps) / statistics.median(offs), 3),
               "acceptance_length": round(1 + accepted / drafts, 2) if drafts else 1.0,
               "accepted_rate": round(accepted / max(1, spec.num_draft_tokens - draft_tok0), 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                            "threads": os.cpu_count(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
