"""Three models in one Serve app over real HTTP (manifests/qwen3-multi-model.yaml's args with
an API key): qwen3-tiny at tp 1, qwen3-moe-tiny at tp 2 and the embedding model
qwen3-embedding-tiny (the pooling runner), each its own LLMServer deployment; the ingress
routes by `model`, each chat model's greedy output equals its offline engine's, and the
embedding model's vectors equal sentence-transformers' on its checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from serve_apps import serve_app

from cluster.api.prometheus import parse_prometheus

pytestmark = pytest.mark.slow

MANIFEST = Path(__file__).resolve().parents[3] / "manifests" / "qwen3-multi-model.yaml"
API_KEY = "multi-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def base_url(ray_cluster: None) -> Iterator[str]:
    args = dict(yaml.safe_load(MANIFEST.read_text())["applications"][0]["args"])
    args["api_key"] = API_KEY
    with serve_app(args, "qwen3-multi") as url:
        yield url


def offline_text(model: str, lora: Any = None) -> str:
    from cluster import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=1, enable_lora=lora is not None)
    try:
        out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False,
                           lora_request=lora)
    finally:
        llm.shutdown()
    return out[0].outputs[0].text


def complete(base_url: str, model: str | None, headers: dict | None = None) -> httpx.Response:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                            "ignore_eos": True}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{base_url}/v1/completions", headers=AUTH if headers is None else headers,
                      json=body, timeout=120)


def test_models_lists_every_base_model(base_url: str) -> None:
    assert httpx.get(f"{base_url}/v1/models", timeout=60).status_code == 401
    data = httpx.get(f"{base_url}/v1/models", headers=AUTH, timeout=60).json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [
        ("qwen3-tiny", None), ("tiny-lora", "qwen3-tiny"), ("qwen3-moe-tiny", None),
        ("qwen3-embedding-tiny", None)]
    assert httpx.get(f"{base_url}/health", timeout=60).status_code == 200


def test_each_request_goes_to_its_models_deployment(base_url: str) -> None:
    dense, moe = complete(base_url, "qwen3-tiny"), complete(base_url, "qwen3-moe-tiny")
    assert dense.status_code == 200 and moe.status_code == 200, (dense.text, moe.text)
    assert (dense.json()["model"], moe.json()["model"]) == ("qwen3-tiny", "qwen3-moe-tiny")
    assert dense.json()["choices"][0]["text"] == offline_text("qwen3-tiny")
    assert moe.json()["choices"][0]["text"] == offline_text("qwen3-moe-tiny")


def test_the_manifests_embedded_adapter_is_served_by_its_name(base_url: str) -> None:
    from cluster import LoRARequest
    from cluster.api.lora_models import lora_int_id

    resp = complete(base_url, "tiny-lora")
    assert resp.status_code == 200 and resp.json()["model"] == "tiny-lora", resp.text
    lora = LoRARequest("tiny-lora", lora_int_id("tiny-lora", "qwen3-tiny-lora"),
                       "qwen3-tiny-lora")
    assert resp.json()["choices"][0]["text"] == offline_text("qwen3-tiny", lora)
    assert resp.json()["choices"][0]["text"] != complete(base_url, "qwen3-tiny").json()[
        "choices"][0]["text"]
    # no model: the first one; the API key is checked once for every model
    assert complete(base_url, None).json()["model"] == "qwen3-tiny"
    assert complete(base_url, "qwen3-moe-tiny", headers={}).status_code == 401
    stream = httpx.post(f"{base_url}/v1/chat/completions", headers=AUTH, timeout=120, json={
        "model": "qwen3-moe-tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4, "stream": True})
    assert stream.status_code == 200 and '"model":"qwen3-moe-tiny"' in stream.text


def test_a_pooling_model_embeds_beside_the_chat_models(base_url: str) -> None:
    from sentence_transformers import SentenceTransformer

    from workers.tiny_model import resolve_model

    texts = ["The capital of France is", "Paris"]
    resp = httpx.post(f"{base_url}/v1/embeddings", headers=AUTH, timeout=120,
                      json={"model": "qwen3-embedding-tiny", "input": texts})
    assert resp.status_code == 200, resp.text
    got = torch.tensor([d["embedding"] for d in resp.json()["data"]])
    ref = SentenceTransformer(resolve_model("qwen3-embedding-tiny"),
                              device="cpu").encode(texts, convert_to_tensor=True)
    assert torch.nn.functional.cosine_similarity(got, ref.float(), dim=1).min() > 0.9999
    # generation on the pooling model, and embeddings from a chat model: 400s naming `model`
    gen = complete(base_url, "qwen3-embedding-tiny")
    emb = httpx.post(f"{base_url}/v1/embeddings", headers=AUTH, timeout=120,
                     json={"model": "qwen3-tiny", "input": "hi"})
    assert (gen.status_code, emb.status_code) == (400, 400), (gen.text, emb.text)
    assert gen.json()["error"]["param"] == emb.json()["error"]["param"] == "model"


def test_an_unknown_model_is_a_404_naming_every_served_one(base_url: str) -> None:
    resp = complete(base_url, "qwen3-huge")
    assert resp.status_code == 404 and resp.headers.get("x-request-id")
    err = resp.json()["error"]
    assert err["code"] == "model_not_found"
    assert "`qwen3-tiny`" in err["message"] and "`qwen3-moe-tiny`" in err["message"]


def test_runtime_adapters_load_on_the_model_the_body_names(base_url: str,
                                                          tmp_path: Path) -> None:
    bad = httpx.post(f"{base_url}/v1/load_lora_adapter", headers=AUTH, timeout=60, json={
        "lora_name": "x", "lora_path": str(tmp_path), "model": "qwen3-moe-tiny"})
    assert bad.status_code == 404  # the MoE model's entry does not allow runtime loading
    assert "allow_runtime_lora_updating" in bad.json()["error"]["message"]
    missing = httpx.post(f"{base_url}/v1/load_lora_adapter", headers=AUTH, timeout=60, json={
        "lora_name": "x", "lora_path": str(tmp_path), "model": "qwen3-tiny"})
    assert missing.status_code == 400 and "adapter_config.json" in missing.text


def test_metrics_have_each_models_series_once_per_family(base_url: str) -> None:
    text = httpx.get(f"{base_url}/metrics", timeout=60).text
    samples = parse_prometheus(text)
    running = sorted(k for k in samples if k.startswith("vllm:num_requests_running{"))
    assert running == ['vllm:num_requests_running{model_name="qwen3-embedding-tiny"}',
                       'vllm:num_requests_running{model_name="qwen3-moe-tiny"}',
                       'vllm:num_requests_running{model_name="qwen3-tiny"}']
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
