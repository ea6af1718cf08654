"""Embeddings: this engine's pooling runner (`LLM.embed`) against sentence-transformers'
`encode` on the same checkpoint, the same inputs and the same machine.

Inputs (seeded): texts decoded from token ids drawn uniformly from [100, 150000), with token
counts uniform in [--min-len, --max-len]; both sides tokenize the same texts (the counts in
the table are this engine's tokens). Per batch size B, the N inputs go B at a time (batch 1:
one `embed` / `encode` call per input; batch 64: calls of 64); each side runs `--repeats`
times after one warm-up pass, alternating, and the figure is the median wall time: inputs/s
and tokens/s. Both run in this process on `--device` (fp32 on CPU with the same torch threads;
the checkpoint's dtype on CUDA, ours as the engine's `dtype: auto`, sentence-transformers'
`model_kwargs={"dtype": "auto"}`); sentence-transformers pads each batch to its longest input.

    .venv/bin/python bench/embed_bench.py [--model qwen3-embedding-tiny] [--batches 1,64]
        [--inputs 64] [--min-len 16] [--max-len 512] [--repeats 3] [--device cpu|cuda]
        [--json out.json]

sentence-transformers is a dev dependency of this project (pyproject.toml): it installs
beside it without changing any pinned package, so no separate virtualenv is needed.
"""

from __future__ import annotations

import argparse
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
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _texts(tokenizer, n: int, low: int, high: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [tokenizer.decode([rng.randrange(100, 150000) for _ in range(rng.randint(low, high))])
            for _ in range(n)]


def _timed(fn, batches: list[list[str]]) -> float:
    t0 = time.perf_counter()
    for b in batches:
        fn(b)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-embedding-tiny")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json")
    args = ap.parse_args()

    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    from cluster import LLM
    from workers.tiny_model import resolve_model

    path = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(path, runner="pooling", device=args.device, max_num_seqs=max(batches),
              max_model_len=args.max_len * 2, max_num_batched_tokens=16384)
    tok = llm.get_tokenizer()
    texts = _texts(tok, args.inputs, args.min_len, args.max_len, args.seed)
    num_tokens = sum(len(tok(t)["input_ids"]) for t in texts)
    st = SentenceTransformer(path, device=args.device, model_kwargs={"dtype": "auto"})
    st.max_seq_length = args.max_len * 2

    def ours(batch: list[str]) -> None:
        llm.embed(batch, use_tqdm=False)

    def theirs(batch: list[str]) -> None:
        with torch.inference_mode():
            st.encode(batch, batch_size=len(batch), convert_to_numpy=True)
        if args.device == "cuda":
            torch.cuda.synchronize()

    rows = []
    for b in batches:
        chunks = [texts[i:i + b] for i in range(0, len(texts), b)]
        _timed(ours, chunks[:2])
        _timed(theirs, chunks[:2])
        times: dict[str, list[float]] = {"engine": [], "sentence-transformers": []}
        for _ in range(args.repeats):
            times["engine"].append(_timed(ours, chunks))
            times["sentence-transformers"].append(_timed(theirs, chunks))
        for name, ts in times.items():
            sec = statistics.median(ts)
            rows.append({"batch": b, "system": name, "seconds": sec,
                         "inputs_per_s": len(texts) / sec, "tokens_per_s": num_tokens / sec})
    llm.shutdown()

    print(f"model {args.model} on {args.device}: {len(texts)} inputs, {num_tokens} tokens "
          f"(lengths {args.min_len}-{args.max_len}), torch threads {torch.get_num_threads()}, "
          f"sentence-transformers {sentence_transformers.__version__}, "
          f"{platform.processor() or platform.machine()}")
    print(f"{'batch':>5} {'system':<22} {'s (median)':>10} {'inputs/s':>9} {'tokens/s':>9} "
          f"{'vs ST':>6}")
    for r in rows:
        peer = next(p for p in rows if p["batch"] == r["batch"]
                    and p["system"] == "sentence-transformers")
        print(f"{r['batch']:>5} {r['system']:<22} {r['seconds']:>10.3f} "
              f"{r['inputs_per_s']:>9.1f} {r['tokens_per_s']:>9.0f} "
              f"{peer['seconds'] / r['seconds']:>5.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "num_tokens": num_tokens,
                                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
