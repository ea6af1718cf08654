"""The pooling routes over real HTTP through Ray Serve: /v1/embeddings (the openai client's
`embeddings.create`, unmodified: it asks for base64), /v1/score and /v1/rerank, each app
started from its shipped manifest (manifests/qwen3-embedding.yaml, qwen3-reranker.yaml), the
vectors and scores against the offline oracles of tests/cluster/engine/test_pooling_engine.py
(sentence-transformers; the Qwen3-Reranker model card's computation), and every bad input a
400 naming its field. The reverse mistake (a pooling route asked of a generation model) runs
on the fake engine's app (no Serve needed to reach it).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import yaml
from fake_engine import FakeEngine, fetch
from session_ports import free_port

from workers.tiny_model import resolve_model

pytestmark = pytest.mark.slow

MANIFESTS = Path(__file__).resolve().parents[3] / "manifests"
TEXTS = ["hello world", "Paged attention stores the KV cache in fixed-size blocks.",
         "The quick brown fox jumps over the lazy dog. " * 12]
QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Gravity pulls bodies together.", "Beijing."]


def _start(name: str, manifest: str, prefix: str, overrides: dict[str, Any]) -> None:
    from ray import serve

    from cluster.api.serve_app import build_app

    args = dict(yaml.safe_load((MANIFESTS / manifest).read_text())["applications"][0]["args"])
    args.update(overrides)
    serve.run(build_app(args), name=name, route_prefix=prefix)


@pytest.fixture(scope="module")
def base_url(ray_cluster: None) -> Iterator[str]:
    from ray import serve
    from ray.serve.context import _get_global_client

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    port = _get_global_client().http_config.port
    # (small Ray shares: the session's cluster has other tests' actors beside these)
    small = {"replica_num_cpus": 0.1, "max_model_len": 512, "max_num_seqs": 8,
             "max_num_batched_tokens": 64}
    _start("pool-embed", "qwen3-embedding.yaml", "/embed", small)
    _start("pool-rerank", "qwen3-reranker.yaml", "/rerank", small)
    yield f"http://127.0.0.1:{port}"
    serve.delete("pool-embed")
    serve.delete("pool-rerank")


@pytest.fixture(scope="module")
def st_model() -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(resolve_model("qwen3-embedding-tiny"), device="cpu")


@pytest.fixture(scope="module")
def st_reference(st_model: Any) -> torch.Tensor:
    return st_model.encode(TEXTS, convert_to_tensor=True)


def _st_ids(st_model: Any, ids: list[int]) -> torch.Tensor:
    """sentence-transformers' embedding of exactly these token ids."""
    with torch.no_grad():
        out = st_model({"input_ids": torch.tensor([ids]),
                        "attention_mask": torch.ones(1, len(ids), dtype=torch.long)})
    return out["sentence_embedding"][0]


def _cos(a: Any, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float32),
                                                       b.float(), dim=0))


def _post(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(base_url + path, json=body, timeout=120)


def test_openai_client_embeddings_create(base_url: str, st_reference: torch.Tensor) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/embed/v1", api_key="none", max_retries=0)
    resp = client.embeddings.create(model="qwen3-embedding-tiny", input=TEXTS)
    assert [d.index for d in resp.data] == [0, 1, 2]
    for d, ref in zip(resp.data, st_reference):
        assert len(d.embedding) == 128 and _cos(d.embedding, ref) > 0.9999
    tok_counts = [len(t) for t in _tokenize(TEXTS)]
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(tok_counts)
    short = client.embeddings.create(model="qwen3-embedding-tiny", input=TEXTS[1], dimensions=32)
    vec = np.array(short.data[0].embedding)
    assert vec.shape == (32,) and abs(np.linalg.norm(vec) - 1) < 1e-5
    assert _cos(vec, st_reference[1][:32]) > 0.9999


def _tokenize(texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model("qwen3-embedding-tiny"))
    return [tok(t)["input_ids"] for t in texts]


def test_token_id_inputs_and_both_encodings(base_url: str, st_reference: torch.Tensor) -> None:
    ids = _tokenize(TEXTS)
    as_float = _post(base_url, "/embed/v1/embeddings", {"input": ids}).json()
    one = _post(base_url, "/embed/v1/embeddings",
                {"input": ids[0], "encoding_format": "base64"}).json()
    for d, ref in zip(as_float["data"], st_reference):
        assert _cos(d["embedding"], ref) > 0.9999
    decoded = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, as_float["data"][0]["embedding"], atol=1e-7)
    assert one["usage"]["prompt_tokens"] == len(ids[0])


def test_more_inputs_than_max_num_seqs_come_back_in_order(base_url: str,
                                                          st_reference: torch.Tensor) -> None:
    ids = _tokenize(TEXTS) * 7  # 21 inputs, in waves of the app's max_num_seqs (8)
    data = _post(base_url, "/embed/v1/embeddings", {"input": ids}).json()["data"]
    assert [d["index"] for d in data] == list(range(21))
    for i, d in enumerate(data):
        assert _cos(d["embedding"], st_reference[i % 3]) > 0.9999


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [100] * 600}, "input"),
    ({"input": [999999999]}, "input"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 129}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "unknown": 1}, "unknown"),
    ({"input": [100] * 513}, "input"),
    ({"input": "hi", "truncate_prompt_tokens": 513}, "truncate_prompt_tokens"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"input": "hi", "truncation_side": "middle"}, "truncation_side"),
    ({"input": "hi", "normalize": True}, "normalize"),
    ({"input": "hi", "use_activation": False}, "use_activation"),
    ({"input": "hi", "embed_dtype": "float16"}, "embed_dtype"),
    ({"input": "hi", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "hi", "endianness": "middle"}, "endianness"),
    ({"input": "hi", "priority": 1}, "priority"),
    ({"input": "hi", "padding": "max_length"}, "padding"),
    ({"input": "hi", "mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "input"),
    ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(base_url: str, body: dict[str, Any],
                                                          param: str) -> None:
    resp = _post(base_url, "/embed/v1/embeddings", body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_generation_and_rerank_asked_of_the_embedding_model_are_400s(base_url: str) -> None:
    for path, body in (("/embed/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/embed/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/embed/v1/rerank", {"query": "q", "documents": ["d"]}),
                       ("/rerank/v1/embeddings", {"input": "hi"})):
        resp = _post(base_url, path, body)
        assert resp.status_code == 400, (path, resp.text)
        assert resp.json()["error"]["param"] == "model", resp.text


def test_rerank_and_score_equal_the_model_card_reference(base_url: str,
                                                        rerank_card_scores: Any) -> None:
    want = rerank_card_scores(resolve_model("qwen3-reranker-tiny"), [(QUERY, d) for d in DOCS])
    rerank = _post(base_url, "/rerank/v1/rerank",
                   {"query": QUERY, "documents": DOCS, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in rerank["results"]] == order
    for r in rerank["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
        assert r["document"] == {"text": DOCS[r["index"]]}
    every = _post(base_url, "/rerank/v1/rerank", {"query": QUERY, "documents": DOCS}).json()
    assert len(every["results"]) == 3
    score = _post(base_url, "/rerank/v1/score", {"text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2]
    assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=1e-5)
    assert score["usage"]["prompt_tokens"] > 3 * 40  # the template's tokens are counted


@pytest.mark.parametrize("path, body, param", [
    ("/rerank/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/rerank/v1/rerank", {"query": "q", "documents": ["word " * 600]}, "documents"),
    ("/rerank/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
    ("/rerank/v1/completions", {"prompt": "hi"}, "model"),
    ("/rerank/v1/rerank", {"query": "q", "documents": [{"content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "documents"),
    ("/rerank/v1/rerank", {"query": {"content": []}, "documents": ["d"]}, "query"),
    ("/rerank/v1/rerank", {"query": "q", "documents": ["d"], "use_activation": False},
     "use_activation"),
    ("/rerank/v1/rerank", {"query": "q", "documents": ["d"], "truncate_prompt_tokens": 600},
     "truncate_prompt_tokens"),
    ("/rerank/v1/score", {"text_1": "a", "text_2": "b", "softmax": True}, "softmax"),
    ("/rerank/v1/score", {"text_1": "a", "text_2": "b", "use_activation": False},
     "use_activation"),
    ("/rerank/v1/score", {"queries": "a", "documents": "b"}, "text_1"),
])
def test_bad_score_requests_are_400s_naming_the_field(base_url: str, path: str,
                                                      body: dict[str, Any], param: str) -> None:
    resp = _post(base_url, path, body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_pooling_routes_of_a_generation_model_are_400s(engine: FakeEngine,
                                                       tokenizer: Any) -> None:
    for path, body in (("/v1/embeddings", {"input": "hi"}),
                       ("/v1/score", {"text_1": "a", "text_2": "b"}),
                       ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        resp = fetch(engine, tokenizer, "POST", path, body)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "model" and "text generation" in err["message"]
    assert engine.calls == []


def test_truncate_prompt_tokens_keeps_the_last_or_first_tokens(base_url: str,
                                                               st_model: Any) -> None:
    ids = [100 + (7919 * i) % 150000 for i in range(600)]
    left = _post(base_url, "/embed/v1/embeddings",
                 {"input": ids, "truncate_prompt_tokens": 100}).json()
    right = _post(base_url, "/embed/v1/embeddings",
                  {"input": [ids], "truncate_prompt_tokens": 100,
                   "truncation_side": "right"}).json()
    assert left["usage"]["prompt_tokens"] == right["usage"]["prompt_tokens"] == 100
    assert _cos(left["data"][0]["embedding"], _st_ids(st_model, ids[-100:])) > 0.9999
    assert _cos(right["data"][0]["embedding"], _st_ids(st_model, ids[:100])) > 0.9999
    short = _post(base_url, "/embed/v1/embeddings",
                  {"input": ids[:50], "truncate_prompt_tokens": 100}).json()
    assert short["usage"]["prompt_tokens"] == 50  # shorter inputs stay whole


def test_an_input_of_max_model_len_tokens_and_truncation_to_it(base_url: str,
                                                               st_model: Any) -> None:
    ids = [100 + (7919 * i) % 150000 for i in range(600)]
    exact = _post(base_url, "/embed/v1/embeddings", {"input": ids[:512]})
    assert exact.status_code == 200, exact.text
    assert _cos(exact.json()["data"][0]["embedding"], _st_ids(st_model, ids[:512])) > 0.9999
    cut = _post(base_url, "/embed/v1/embeddings", {"input": ids, "truncate_prompt_tokens": -1})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 512
    assert _cos(cut.json()["data"][0]["embedding"], _st_ids(st_model, ids[-512:])) > 0.9999


def test_embedding_options_vllm_clients_send(base_url: str, st_reference: torch.Tensor) -> None:
    plain = _post(base_url, "/embed/v1/embeddings", {"input": TEXTS[1]}).json()
    vec = plain["data"][0]["embedding"]
    same = _post(base_url, "/embed/v1/embeddings", {
        "input": TEXTS[1], "user": "u-1", "request_id": "r-1", "priority": 0,
        "use_activation": True, "embed_dtype": "float32", "padding": "do_not_pad",
        "cache_salt": "salt-1", "add_special_tokens": True}).json()
    assert same["data"][0]["embedding"] == pytest.approx(vec, abs=1e-6)
    big = _post(base_url, "/embed/v1/embeddings", {"input": TEXTS[1], "endianness": "big",
                                                   "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(big["data"][0]["embedding"]), dtype=">f4")
    assert np.allclose(decoded, vec, atol=1e-7)
    assert _cos(vec, st_reference[1]) > 0.9999
    bare = _post(base_url, "/embed/v1/embeddings",
                 {"input": TEXTS[1], "add_special_tokens": False}).json()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model("qwen3-embedding-tiny"))
    assert bare["usage"]["prompt_tokens"] == len(tok(TEXTS[1], add_special_tokens=False)
                                                 ["input_ids"])


def test_rerank_documents_as_content_objects_and_truncation(base_url: str,
                                                            rerank_card_scores: Any) -> None:
    path = resolve_model("qwen3-reranker-tiny")
    want = rerank_card_scores(path, [(QUERY, d) for d in DOCS])
    docs = [DOCS[0], {"content": [{"type": "text", "text": DOCS[1]}]},
            {"content": [{"type": "text", "text": "Beijing"}, {"type": "text", "text": "."}]}]
    got = _post(base_url, "/rerank/v1/rerank",
                {"query": {"content": [{"type": "text", "text": QUERY}]},
                 "documents": docs, "user": "u"}).json()["results"]
    by_index = {r["index"]: r for r in got}
    assert by_index[0]["relevance_score"] == pytest.approx(want[0], abs=1e-5)
    assert by_index[1]["relevance_score"] == pytest.approx(want[1], abs=1e-5)
    joined = rerank_card_scores(path, [(QUERY, "Beijing\n.")])[0]  # parts joined by newlines
    assert by_index[2]["relevance_score"] == pytest.approx(joined, abs=1e-5)
    assert by_index[0]["document"] == {"text": DOCS[0]}
    assert by_index[1]["document"] == {"multi_modal": [{"type": "text", "text": DOCS[1]}]}
    cut = _post(base_url, "/rerank/v1/rerank", {"query": QUERY, "documents": DOCS,
                                                "truncate_prompt_tokens": 30}).json()
    short = rerank_card_scores(path, [(QUERY, d) for d in DOCS], keep_last=30)
    assert cut["usage"]["prompt_tokens"] == 90
    assert {r["index"]: r["relevance_score"] for r in cut["results"]} == pytest.approx(
        dict(enumerate(short)), abs=1e-5)
    score = _post(base_url, "/rerank/v1/score", {"text_1": QUERY, "text_2": DOCS,
                                                 "truncate_prompt_tokens": 30}).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(short, abs=1e-5)
