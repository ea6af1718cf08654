"""Pooling batch jobs on the shared Ray cluster: `build_processor` over an embedding model gives
LLM.embed's vectors in the `embeddings` column, every row exactly once though its engine actor
is SIGKILLed mid-job; over the reranker, LLM.score's scores; and `python -m cluster.batch`
runs an OpenAI batch file of /v1/embeddings lines (a chat line among them) end to end;
at tensor-parallel size 2 the vectors are the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_kill import consume_killing_one_engine

from cluster.batch import ProcessorConfig, build_processor
from cluster.batch.stages import tokenizer_for
from cluster.engine.llm import LLM
from cluster.engine.pooling import rerank_prompt_ids

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
EMBED = dict(model="qwen3-embedding-tiny", max_model_len=128)
RERANK = dict(model="qwen3-reranker-tiny", max_model_len=256, hf_overrides={
    "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True})
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "ember"]


def _text(i: int) -> str:
    return " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(4 + i % 40)) + f" {i}"


def test_embedding_rows_equal_llm_embed_and_come_out_once_after_a_kill(
        ray_cluster: None) -> None:
    import ray.data

    n = 400  # enough batches that the job is still running when the first rows are out
    rows: list[dict[str, Any]] = [{"id": i, "prompt": _text(i)} for i in range(n)]
    tok = tokenizer_for("qwen3-embedding-tiny")
    for row in rows[1::2]:  # every other row as token ids, as LLM.embed tokenizes them
        row["prompt_token_ids"] = tok.encode(row.pop("prompt"), add_special_tokens=True)
    rows += [{"id": n, "prompt": "word " * 200}]  # too long: its error, not a crash
    processor = build_processor(ProcessorConfig(
        engine_kwargs=EMBED, engine_num_cpus=0.5, batch_size=4, max_batches_in_flight=2,
        apply_chat_template=False))
    out, done_before_kill = consume_killing_one_engine(
        processor(ray.data.from_items(rows, override_num_blocks=4)))
    assert 0 < done_before_kill < len(rows)
    assert sorted(r["id"] for r in out) == list(range(n + 1))
    with LLM(**EMBED) as llm:
        want = llm.embed([_text(i) for i in range(n)], use_tqdm=False)
    by_id = {r["id"]: r for r in out}
    for i, ref in enumerate(want):
        assert by_id[i]["error"] is None, by_id[i]["error"]
        np.testing.assert_allclose(by_id[i]["embeddings"], ref.outputs.embedding, rtol=0,
                                   atol=1e-5)
    assert by_id[n]["embeddings"] is None and "max_model_len is 128" in by_id[n]["error"]


def test_reranker_rows_equal_llm_score(ray_cluster: None) -> None:
    """Rows of (query, document) put in the model card's template by a preprocess."""
    import ray.data

    query = "What is the capital of China?"
    docs = ["The capital of China is Beijing.", "Gravity pulls bodies together.", "Beijing.",
            "Paris is in France."]
    tok = tokenizer_for("qwen3-reranker-tiny")
    processor = build_processor(
        ProcessorConfig(engine_kwargs=RERANK, engine_num_cpus=0.5, batch_size=2,
                        apply_chat_template=False),
        preprocess=lambda row: {**row, "prompt_token_ids": rerank_prompt_ids(
            tok, row["query"], row["document"])})
    out = processor(ray.data.from_items([{"i": i, "query": query, "document": d}
                                         for i, d in enumerate(docs)])).take_all()
    with LLM(**RERANK) as llm:
        want = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    got = {r["i"]: r["score"] for r in out}
    np.testing.assert_allclose([got[i] for i in range(len(docs))], want, rtol=0, atol=1e-5)


def test_cli_runs_an_embeddings_batch_file(ray_cluster: None, tmp_path: Path) -> None:
    import ray

    texts = [_text(i) for i in range(5)]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": t}} for i, t in enumerate(texts)]
    lines += [{"custom_id": "many", "method": "POST", "url": "/v1/embeddings",
               "body": {"input": texts[:3], "dimensions": 16}},
              {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
               "body": {"messages": [{"role": "user", "content": "hi"}]}}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.batch", str(src), str(dst), "--model",
         "qwen3-embedding-tiny", "--max-model-len", "128", "--engine-num-cpus", "0.5",
         "--batch-size", "4"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "batch: 7 rows, 1 failed" in proc.stderr
    by_id = {r["custom_id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    with LLM(**EMBED) as llm:
        want = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
        short = [o.outputs.embedding for o in llm.embed(texts[:3], use_tqdm=False,
                                                        dimensions=16)]
    for i, ref in enumerate(want):
        body = by_id[f"e{i}"]["response"]["body"]
        assert body["model"] == "qwen3-embedding-tiny" and body["usage"]["prompt_tokens"] > 0
        np.testing.assert_allclose(body["data"][0]["embedding"], ref, rtol=0, atol=1e-5)
    many = by_id["many"]["response"]["body"]["data"]
    np.testing.assert_allclose([d["embedding"] for d in many], short, rtol=0, atol=1e-5)
    chat = by_id["chat"]["response"]
    assert chat["status_code"] == 400 and chat["body"]["error"]["param"] == "model"


def test_tensor_parallel_embedding_engines_give_the_same_vectors(ray_cluster: None) -> None:
    """tp 2: the engine actor starts its own two Ray workers in their own placement group."""
    import ray.data

    texts = [_text(i) for i in range(8)]
    config = ProcessorConfig(engine_kwargs=dict(EMBED, tensor_parallel_size=2,
                                                worker_num_cpus=0.5),
                             engine_num_cpus=0.25, batch_size=4, apply_chat_template=False)
    out = build_processor(config)(ray.data.from_items(
        [{"i": i, "prompt": t} for i, t in enumerate(texts)])).take_all()
    with LLM(**EMBED) as llm:
        want = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    got = {r["i"]: r["embeddings"] for r in out}
    np.testing.assert_allclose([got[i] for i in range(len(texts))], want, rtol=0, atol=1e-5)
