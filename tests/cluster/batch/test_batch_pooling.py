"""Batch jobs for pooling models: OpenAI batch lines for /v1/embeddings, /v1/score and
/v1/rerank read as the HTTP routes read them (bad fields and mixed files answered line by line
with the route's 400), and the engine stage's pooling path run in this process (no Ray: the
stage is a plain class) against LLM.embed / LLM.score, its rows formatted into the HTTP
routes' bodies. The same through Ray Data and the CLI is test_batch_pooling_ray.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from cluster.batch.engine_stage import EngineStage
from cluster.batch.openai_batch import ModelFacts, read_request, write_result
from cluster.engine.config import EngineConfig
from cluster.engine.llm import LLM

EMBED = dict(model="qwen3-embedding-tiny", max_model_len=128)
RERANK = dict(model="qwen3-reranker-tiny", max_model_len=256, hf_overrides={
    "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True})
TEXTS = ["hello world", "Paged attention stores the KV cache in fixed-size blocks.",
         "The quick brown fox jumps over the lazy dog. " * 3]
QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Gravity pulls bodies together.", "Beijing."]


def _line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, str]:
    return {"text": json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                                "body": body})}


@pytest.fixture(scope="module")
def embed_facts() -> ModelFacts:
    return ModelFacts.of(EngineConfig(**EMBED))


@pytest.fixture(scope="module")
def rerank_facts() -> ModelFacts:
    return ModelFacts.of(EngineConfig(**RERANK))


def _param(row: dict[str, Any]) -> tuple[int, str | None]:
    return row["status_code"], json.loads(row["error_body"])["error"]["param"]


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[1, 2], [999999]]}, "input"),
    ({"input": "x", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "x", "embed_dtype": "float16"}, "embed_dtype"),
    ({"input": "x", "dimensions": 4096}, "dimensions"),
    ({"input": "word " * 200}, "input"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "normalize": True}, "normalize"),
    ({"inputs": "x"}, "input"),  # (the missing field first, as the route says)
])
def test_bad_embedding_lines_are_the_routes_400_naming_the_field(
        embed_facts: ModelFacts, body: dict[str, Any], param: str) -> None:
    row = read_request(_line("a", "/v1/embeddings", body), embed_facts)
    assert row["request_error"] is None and _param(row) == (400, param), row["error"]
    assert "pooling_inputs" not in row


@pytest.mark.parametrize("url, body, param", [
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": {"content": [{"type": "image_url"}]}, "documents": ["d"]},
     "query"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "use_activation": False}, "use_activation"),
])
def test_bad_score_lines_are_the_routes_400_naming_the_field(
        rerank_facts: ModelFacts, url: str, body: dict[str, Any], param: str) -> None:
    row = read_request(_line("a", url, body), rerank_facts)
    assert _param(row) == (400, param), row["error"]


def test_a_mixed_file_is_answered_line_by_line_as_vllm_run_batch_does(
        embed_facts: ModelFacts, rerank_facts: ModelFacts) -> None:
    """Each line the model cannot serve gets the HTTP route's 400 naming `model`; the job
    goes on (vLLM: "The model does not support Embeddings API", per line)."""
    chat = read_request(_line("c", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hi"}]}), embed_facts)
    assert _param(chat) == (400, "model") and "is a pooling model" in chat["error"]
    rerank = read_request(_line("r", "/v1/rerank", {"query": "q", "documents": ["d"]}),
                          embed_facts)
    assert _param(rerank) == (400, "model")
    assert rerank["error"] == ("/v1/rerank needs a pooling model serving the 'score' task; "
                               "`qwen3-embedding-tiny` serves the 'embed' task")
    generate = ModelFacts.of(EngineConfig(model="qwen3-tiny", max_model_len=128))
    embed = read_request(_line("e", "/v1/embeddings", {"input": "x"}), generate)
    assert _param(embed) == (400, "model") and "serves text generation" in embed["error"]
    unknown = read_request(_line("u", "/v1/classify", {"input": "x"}), rerank_facts)
    assert unknown["request_error"] == (
        "url must be one of ['/v1/chat/completions', '/v1/completions', '/v1/embeddings', "
        "'/v1/score', '/v1/rerank']; got '/v1/classify'")
    good = read_request(_line("g", "/v1/embeddings", {"input": [[5, 6, 7], [8]]}),
                        embed_facts)
    assert good["error"] is None and good["pooling_inputs"] == [[5, 6, 7], [8]]


def _run_stage(engine: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The engine stage's answer to one batch of `rows`, in this process."""
    stage = EngineStage(engine)
    try:
        out = asyncio.run(stage(pa.Table.from_pylist(rows)))
    finally:
        stage._shutdown()
    return pa.table(out).to_pylist()


def test_embedding_lines_give_llm_embed_vectors_in_the_routes_body(
        embed_facts: ModelFacts) -> None:
    lines = [_line("all", "/v1/embeddings", {"input": TEXTS}),
             _line("b64", "/v1/embeddings", {"input": TEXTS[1], "encoding_format": "base64",
                                             "dimensions": 32}),
             _line("bad", "/v1/embeddings", {"input": []})]
    rows = [read_request(line, embed_facts) for line in lines]
    out = [json.loads(write_result(r, "emb", embed_facts.pooling)["line"])
           for r in _run_stage(EMBED, rows)]
    with LLM(**EMBED) as llm:
        want = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
        want32 = llm.embed(TEXTS[1], use_tqdm=False, dimensions=32)[0].outputs.embedding
    body = out[0]["response"]["body"]
    assert out[0]["custom_id"] == "all" and out[0]["response"]["status_code"] == 200
    assert body["object"] == "list" and body["model"] == "emb" and body["id"].startswith("embd-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for got, ref in zip(body["data"], want):
        np.testing.assert_allclose(got["embedding"], ref, rtol=0, atol=1e-5)
        assert abs(np.linalg.norm(got["embedding"]) - 1.0) < 1e-5
    n = sum(map(len, rows[0]["pooling_inputs"]))
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    vec = np.frombuffer(base64.b64decode(out[1]["response"]["body"]["data"][0]["embedding"]),
                        dtype="<f4" if np.little_endian else ">f4")
    assert vec.shape == (32,)
    np.testing.assert_allclose(vec, want32, rtol=0, atol=1e-5)
    bad = out[2]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "input"


def test_score_and_rerank_lines_give_llm_score_in_the_routes_bodies(
        rerank_facts: ModelFacts) -> None:
    lines = [_line("rr", "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2}),
             _line("sc", "/v1/score", {"text_1": QUERY, "text_2": DOCS})]
    rows = [read_request(line, rerank_facts) for line in lines]
    out = [json.loads(write_result(r, "rr", rerank_facts.pooling)["line"])["response"]
           for r in _run_stage(RERANK, rows)]
    with LLM(**RERANK) as llm:
        want = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    rerank, score = out[0]["body"], out[1]["body"]
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in rerank["results"]] == best
    assert [r["document"] for r in rerank["results"]] == [{"text": DOCS[i]} for i in best]
    np.testing.assert_allclose([r["relevance_score"] for r in rerank["results"]],
                               [want[i] for i in best], rtol=0, atol=1e-5)
    assert [d["index"] for d in score["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, rtol=0, atol=1e-5)
    assert score["object"] == "list" and score["id"].startswith("score-")


def test_processor_rows_get_embeddings_or_their_error() -> None:
    """A processor row (token ids, no OpenAI body) gets Ray Data LLM's `embeddings` column;
    sampling parameters on a pooling engine are that row's error, not ignored."""
    ids = [[6023, 1052], [5, 6, 7, 8]]
    rows = [{"id": 0, "prompt_token_ids": ids[0], "sampling_params": None, "error": None},
            {"id": 1, "prompt_token_ids": ids[1], "sampling_params": None, "error": None},
            {"id": 2, "prompt_token_ids": [5], "sampling_params": '{"max_tokens": 3}',
             "error": None},
            {"id": 3, "prompt_token_ids": list(range(10, 140)), "sampling_params": None,
             "error": None}]
    out = _run_stage(EMBED, rows)
    with LLM(**EMBED) as llm:
        want = [o.outputs.embedding for o in llm.embed(
            [{"prompt_token_ids": i} for i in ids], use_tqdm=False)]
    for row, ref in zip(out[:2], want):
        assert row["error"] is None and row["num_input_tokens"] == len(ids[row["id"]])
        np.testing.assert_allclose(row["embeddings"], ref, rtol=0, atol=1e-5)
    assert out[2]["embeddings"] is None and out[2]["error"].startswith("sampling_params: ")
    assert out[3]["embeddings"] is None and "an input has 130 tokens" in out[3]["error"]
