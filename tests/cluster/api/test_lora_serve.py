"""LoRA adapters over real HTTP: one Serve app (two tp-1 qwen3-tiny replicas, LoRA on, an API
key) serving an adapter from `lora_modules`, one loaded at runtime and one from the resolver
directory; greedy outputs equal the offline engine's under the same adapter (which
tests/cluster/engine/test_lora_engine.py holds to transformers with peft's merge)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lora_adapters import make_adapter
from serve_apps import serve_app

from cluster.api.prometheus import parse_prometheus

pytestmark = pytest.mark.slow

API_KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    (root / "resolvable").mkdir()
    return {
        "static": make_adapter(tiny_model_path, root / "static", r=8, seed=11),
        "runtime": make_adapter(tiny_model_path, root / "runtime", r=4, seed=12,
                                target_modules=["q_proj", "v_proj", "down_proj"]),
        "resolved": make_adapter(tiny_model_path, root / "resolvable" / "resolved", r=8,
                                 seed=13),
        "too_big": make_adapter(tiny_model_path, root / "too_big", r=32, seed=14,
                                target_modules=["q_proj"]),
    }


@pytest.fixture(scope="module")
def base_url(ray_cluster: None, adapters: dict[str, str]) -> Iterator[str]:
    args = {"model": "qwen3-tiny", "tensor_parallel_size": 1, "device": "cpu",
            "executor": "inprocess", "replica_num_cpus": 0.5, "ingress_num_cpus": 0.1,
            "swap_space": 0.1, "max_num_seqs": 16, "num_replicas": 2,
            "enable_lora": True, "max_loras": 2, "max_lora_rank": 16, "api_key": API_KEY,
            "lora_modules": [{"name": "static", "path": adapters["static"]}],
            "allow_runtime_lora_updating": True,
            "dynamic_lora_loading_path": str(Path(adapters["resolved"]).parent)}
    with serve_app(args, "qwen3-lora") as url:
        yield url


@pytest.fixture(scope="module")
def offline(tiny_model_path: str) -> Iterator[Any]:
    from cluster import LLM

    llm = LLM("qwen3-tiny", enable_lora=True, max_loras=2, max_lora_rank=16)
    yield llm
    llm.shutdown()


def offline_text(offline: Any, name: str | None, path: str | None) -> str:
    from cluster import LoRARequest, SamplingParams
    from cluster.api.lora_models import lora_int_id

    lora = None if name is None else LoRARequest(name, lora_int_id(name, path), path)
    out = offline.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True),
                           use_tqdm=False, lora_request=lora)
    return out[0].outputs[0].text


def complete(base_url: str, model: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", headers=AUTH, timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, **extra})


def text_of(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def test_models_lists_the_adapter_with_its_base_as_parent(base_url: str,
                                                          adapters: dict[str, str]) -> None:
    data = httpx.get(f"{base_url}/v1/models", headers=AUTH, timeout=60).json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [("qwen3-tiny", None),
                                                      ("static", "qwen3-tiny")]
    assert data[1]["root"] == adapters["static"]


def test_model_picks_the_adapter_and_equals_the_offline_engine(
        base_url: str, adapters: dict[str, str], offline: Any) -> None:
    base, adapted = text_of(complete(base_url, "qwen3-tiny")), text_of(complete(base_url, "static"))
    assert base == offline_text(offline, None, None)
    assert adapted == offline_text(offline, "static", adapters["static"])
    assert adapted != base
    resp = complete(base_url, "static")
    assert resp.json()["model"] == "static"
    stream = httpx.post(f"{base_url}/v1/completions", headers=AUTH, timeout=120, json={
        "model": "static", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "stream": True})
    chunks = [line[6:] for line in stream.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    import json

    assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks) == adapted


def test_chat_and_responses_run_under_the_adapter(base_url: str, adapters: dict[str, str],
                                                  offline: Any) -> None:
    from cluster import LoRARequest, SamplingParams
    from cluster.api.lora_models import lora_int_id

    messages = [{"role": "user", "content": "Say hi"}]
    kw = {"chat_template_kwargs": {"enable_thinking": False}}
    chat = httpx.post(f"{base_url}/v1/chat/completions", headers=AUTH, timeout=120, json={
        "model": "static", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, **kw})
    assert chat.status_code == 200, chat.text
    lora = LoRARequest("static", lora_int_id("static", adapters["static"]), adapters["static"])
    local = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True),
                         use_tqdm=False, lora_request=lora, chat_template_kwargs=kw[
                             "chat_template_kwargs"])[0]
    assert chat.json()["choices"][0]["message"]["content"] == local.outputs[0].text
    assert chat.json()["model"] == "static"
    resp = httpx.post(f"{base_url}/v1/responses", headers=AUTH, timeout=120, json={
        "model": "static", "input": "Say hi", "max_output_tokens": MAX_TOKENS,
        "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "static"


def test_unknown_model_is_404_with_an_openai_body(base_url: str) -> None:
    resp = complete(base_url, "nope")
    assert resp.status_code == 404
    err = resp.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "`static`" in err["message"] and "`qwen3-tiny`" in err["message"]
    assert complete(base_url, "../resolvable/resolved").status_code == 404


def test_load_and_unload_at_runtime(base_url: str, adapters: dict[str, str],
                                    offline: Any) -> None:
    load = f"{base_url}/v1/load_lora_adapter"
    unload = f"{base_url}/v1/unload_lora_adapter"
    body = {"lora_name": "runtime", "lora_path": adapters["runtime"]}
    assert httpx.post(load, json=body, timeout=60).status_code == 401  # the API key
    bad = httpx.post(load, headers=AUTH, timeout=60,
                     json={"lora_name": "big", "lora_path": adapters["too_big"]})
    assert bad.status_code == 400 and "max_lora_rank=16" in bad.json()["error"]["message"]
    missing = httpx.post(load, headers=AUTH, timeout=60, json={"lora_name": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"

    ok = httpx.post(load, headers=AUTH, json=body, timeout=60)
    assert ok.status_code == 200, ok.text
    assert httpx.post(load, headers=AUTH, json=body, timeout=60).status_code == 400
    ids = [m["id"] for m in httpx.get(f"{base_url}/v1/models", headers=AUTH).json()["data"]]
    assert ids == ["qwen3-tiny", "static", "runtime"]
    assert text_of(complete(base_url, "runtime")) == \
        offline_text(offline, "runtime", adapters["runtime"])

    assert httpx.post(unload, headers=AUTH, json={"lora_name": "runtime"}).status_code == 200
    assert complete(base_url, "runtime").status_code == 404
    gone = httpx.post(unload, headers=AUTH, json={"lora_name": "runtime"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_resolver_loads_a_named_adapter_on_first_use(base_url: str, adapters: dict[str, str],
                                                     offline: Any) -> None:
    assert text_of(complete(base_url, "resolved")) == \
        offline_text(offline, "resolved", adapters["resolved"])
    ids = [m["id"] for m in httpx.get(f"{base_url}/v1/models", headers=AUTH).json()["data"]]
    assert "resolved" in ids


def test_metrics_name_the_adapters(base_url: str) -> None:
    assert complete(base_url, "static").status_code == 200
    text = httpx.get(f"{base_url}/metrics", timeout=60).text
    samples = parse_prometheus(text)
    info = [k for k in samples if k.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0]
    assert 'running_lora_adapters="' in info[0] and 'waiting_lora_adapters="' in info[0]
    counts = {k: v for k, v in samples.items() if k.startswith("qwen3_serve:lora_requests_total")}
    assert counts[next(k for k in counts if 'lora_name="static"' in k)] >= 3
    loaded = [k for k in samples if k.startswith("qwen3_serve:replica_lora_loaded{")]
    assert any('lora_name="static"' in k for k in loaded)


def test_an_adapters_requests_go_to_the_replica_that_has_it_loaded(base_url: str) -> None:
    replicas = []
    for i in range(6):  # short prompts in no common block: only the adapter draws them
        resp = httpx.post(f"{base_url}/v1/completions", headers=AUTH, timeout=120, json={
            "model": "static", "prompt": f"Note {i}", "max_tokens": 2, "temperature": 0})
        assert resp.status_code == 200, resp.text
        replicas.append(resp.headers["x-replica-id"])
    assert len(set(replicas)) == 1, replicas
    text = httpx.get(f"{base_url}/metrics", timeout=60).text
    holders = {k.split('replica="')[1].split('"')[0] for k in parse_prometheus(text)
               if k.startswith("qwen3_serve:replica_lora_loaded{") and 'lora_name="static"' in k}
    assert holders == {replicas[0]}
