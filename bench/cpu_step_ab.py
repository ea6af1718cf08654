"""The engine's decode on CPU with this tree's CPU kernels against other ones, one process.

Runs bench/throughput.py's request generator through one offline `LLM` (tp 1, in-process
executor) and alternates, round by round (after an uncounted pass of each, in alternating order),
one of `kernels.ops`' CPU modules: `--part attention` (the default) this tree's
`kernels/cpu_attention.py` against the one at `--against` (loaded by
bench/cpu_decode_bench.py's `load_ref`); `--part fused` this tree's `kernels/cpu_fused.py`
(RMSNorm, SiLU-and-mul, the attention prologue) against the reference twins it replaces. The
machine's load hits both alike. Reports tok/s (wall)
and tokens per CPU-second of the process (less swayed by other processes' load) per round and whether the greedy tokens of the two are equal.

    python bench/cpu_step_ab.py [--part attention|fused] [--model qwen3-0.6b-random]
        [--dtype bfloat16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_decode_bench import load_ref  # noqa: E402
from throughput import make_requests, model_path  # noqa: E402

from cluster import LLM, SamplingParams  # noqa: E402
from kernels import cpu_attention, cpu_fused, ops, reference  # noqa: E402


class _Ref:
    """The other ref's module behind this tree's call (it takes no step cache)."""

    def __init__(self, module: object) -> None:
        self.module = module

    def paged_attention(self, *args: object) -> object:
        return self.module.paged_attention(*args[:9])  # (drops the step cache)


class _Twins:
    """The reference twins behind `kernels.ops`' calls into kernels/cpu_fused.py."""

    rms_norm = staticmethod(reference.rms_norm)
    silu_and_mul = staticmethod(reference.silu_and_mul)

    @staticmethod
    def qk_norm_rope_write_kv(*args: object) -> object:
        return reference.qk_norm_rope_write_kv(*args[:13])  # (drops the step cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("attention", "fused"), default="attention")
    parser.add_argument("--against", default="main", help="the git ref of --part attention")
    parser.add_argument("--model", default="qwen3-0.6b-random")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--output", type=int, nargs=2, default=(32, 64))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    reqs = make_requests(dict(n=args.requests, prompt=tuple(args.prompt),
                              output=tuple(args.output)))
    llm = LLM(model_path(args.model), dtype=args.dtype, seed=0)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    if args.part == "attention":
        slot, impls = "cpu_attention", {"ours": cpu_attention,
                                        args.against: _Ref(load_ref(args.against))}
    else:
        slot, impls = "cpu_fused", {"ours": cpu_fused, "twins": _Twins()}
    rates: dict[str, list[float]] = {k: [] for k in impls}
    cpu_rates: dict[str, list[float]] = {k: [] for k in impls}
    tokens: dict[str, list] = {}
    # One uncounted pass each first (the KV cache's pages are touched on first use), then the
    # order alternates round by round so neither side always runs first.
    pairs = list(impls.items())
    schedule = [(pairs, False)] + [(pairs[::-1] if r % 2 else pairs, True)
                                   for r in range(args.rounds)]
    for order, counted in schedule:
        for name, impl in order:
            setattr(ops, slot, impl)
            start, cpu = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
            rate, per_cpu = sum(map(len, tokens[name])) / wall, sum(map(len, tokens[name])) / cpu
            if counted:
                rates[name].append(rate)
                cpu_rates[name].append(per_cpu)
            print(f"{name:6s} {rate:7.1f} tok/s  {per_cpu:7.1f} tok per CPU-s  ({wall:.1f} s)"
                  f"{'' if counted else ' warm-up'}", flush=True)
    setattr(ops, slot, impls["ours"])
    same = sum(a == b for a, b in zip(*tokens.values()))
    print("median tok/s: " + ", ".join(f"{k} {statistics.median(v):.1f}"
                                       for k, v in rates.items())
          + "; tok per CPU-second: " + ", ".join(f"{k} {statistics.median(v):.1f}"
                                                 for k, v in cpu_rates.items())
          + f"; greedy outputs equal: {same} of {len(reqs)}")


if __name__ == "__main__":
    main()
