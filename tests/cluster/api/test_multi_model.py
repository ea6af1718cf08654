"""Several base models in one app without Ray: the manifest's `models` list and its refusals,
and the dispatch by `model` over two fake engines (the real stack:
test_multi_model_serve.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fake_engine import FakeEngine

from cluster.api.engine_client import LocalEngineClient
from cluster.api.lora_models import LoRAModels
from cluster.api.multi_model import (
    ModelDispatch,
    deployment_name,
    merge_metric_texts,
    model_entries,
)
from cluster.api.openai_api import create_app
from cluster.api.serve_app import check_args, split_args

MANIFEST = Path(__file__).resolve().parents[3] / "manifests" / "qwen3-multi-model.yaml"


def _model(name: str, **kw: Any) -> dict[str, Any]:
    return {"model": name, "device": "cpu", **kw}


def test_the_shipped_manifest_has_one_deployment_per_model() -> None:
    args = yaml.safe_load(MANIFEST.read_text())["applications"][0]["args"]
    entries = model_entries(args, split_args)
    assert [(c.model, c.tensor_parallel_size, s["ingress_num_cpus"]) for c, s in entries] == [
        ("qwen3-tiny", 1, 0.1), ("qwen3-moe-tiny", 2, 0.1), ("qwen3-embedding-tiny", 1, 0.1)]
    assert entries[0][1]["lora_modules"] == [{"name": "tiny-lora", "path": "qwen3-tiny-lora"}]
    assert [deployment_name(c, s, True) for c, s in entries] == [
        "LLMServer-qwen3-tiny", "LLMServer-qwen3-moe-tiny", "LLMServer-qwen3-embedding-tiny"]
    one = model_entries({"model": "qwen3-tiny"}, split_args)  # one-model args: as before
    assert len(one) == 1 and deployment_name(*one[0], False) == "LLMServer"


@pytest.mark.parametrize("args, message", [
    ({"models": []}, "models must be a non-empty list"),
    ({"models": "qwen3-tiny"}, "models must be a non-empty list"),
    ({"models": [_model("qwen3-tiny")], "num_replicas": 2},
     r"the top-level args are the ingress's only .* move \['num_replicas'\]"),
    ({"models": [_model("qwen3-tiny", api_key="k")]},
     r"models\[0\] sets \['api_key'\]: the ingress's keys go at the top level"),
    ({"models": ["qwen3-tiny"]}, r"models\[0\] must be a mapping"),
    ({"models": [_model("qwen3-tiny"), _model("qwen3-tiny")]},
     r"models\[1\] serves 'qwen3-tiny', which models\[0\] serves too"),
    ({"models": [_model("qwen3-tiny"), _model("qwen3-moe-tiny", served_model_name="qwen3-tiny")]},
     r"models\[1\] serves 'qwen3-tiny'"),
    ({"models": [_model("qwen3-tiny"), _model("qwen3-moe-tiny", tensor_parallel_size=0)]},
     r"models\[1\]: .*tensor_parallel_size"),
    ({"models": [_model("qwen3-tiny", bogus=1)]}, r"models\[0\]: .*bogus"),
])
def test_bad_models_lists_are_refused_naming_the_entry(args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_args(args)


def test_an_adapter_name_may_not_be_another_models_name(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    lora = {"enable_lora": True, "lora_modules": [{"name": "qwen3-moe-tiny",
                                                   "path": str(tmp_path)}]}
    with pytest.raises(ValueError, match=r"models\[1\] serves 'qwen3-moe-tiny', which "
                                         r"models\[0\] serves too"):
        check_args({"models": [_model("qwen3-tiny", **lora), _model("qwen3-moe-tiny")]})


def test_metric_texts_merge_into_one_family_each() -> None:
    a = '# HELP m Help.\n# TYPE m gauge\nm{model_name="a"} 1\n# HELP c C.\n# TYPE c counter\n' \
        'c_total{model_name="a"} 2\n'
    b = a.replace('"a"', '"b"')
    assert merge_metric_texts([a, b]) == (
        '# HELP m Help.\n# TYPE m gauge\nm{model_name="a"} 1\nm{model_name="b"} 1\n'
        '# HELP c C.\n# TYPE c counter\nc_total{model_name="a"} 2\nc_total{model_name="b"} 2\n')


class _Named(FakeEngine):
    def __init__(self, tokenizer: Any, name: str) -> None:
        super().__init__(tokenizer)
        self.model_name = name


def _dispatch(tokenizer: Any, resolver: str | None = None) -> tuple[Any, list[_Named]]:
    engines = [_Named(tokenizer, "dense"), _Named(tokenizer, "moe")]
    apps = [create_app(LocalEngineClient(e), tokenizer,
                       loras=LoRAModels(resolver_dir=resolver) if i == 1 else None)
            for i, e in enumerate(engines)]
    return ModelDispatch(apps, "key"), engines


def _send(app: Any, method: str, path: str, body: Any = None,
          key: str | None = "key") -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return await client.request(method, path, headers=headers,
                                        content=None if body is None else json.dumps(body))
    return asyncio.run(go())


def test_dispatch_sends_each_request_to_the_model_it_names(tokenizer: Any,
                                                           tmp_path: Path) -> None:
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter_config.json").write_text("{}")
    app, (dense, moe) = _dispatch(tokenizer, str(tmp_path))
    body = {"prompt": "hi", "max_tokens": 2}
    assert _send(app, "POST", "/v1/completions", {**body, "model": "moe"}).json()["model"] == "moe"
    assert _send(app, "POST", "/v1/completions", body).json()["model"] == "dense"
    assert (len(dense.calls), len(moe.calls)) == (1, 1)
    # a name the second model's resolver directory holds goes to it (which then loads it)
    assert app._app_for("ad", [a.state.serving for a in app.apps]) is app.apps[1]
    assert _send(app, "POST", "/v1/completions", {**body, "model": "moe"},
                 key=None).status_code == 401
    missing = _send(app, "POST", "/v1/completions", {**body, "model": "other"})
    assert missing.status_code == 404
    assert "`dense`, `moe`" in missing.json()["error"]["message"]
    models = _send(app, "GET", "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["dense", "moe"]
    assert _send(app, "GET", "/v1/models", key=None).status_code == 401
    assert _send(app, "GET", "/health").status_code == 200
    moe.dead = "gone"
    assert _send(app, "GET", "/health").status_code == 503
    text = _send(app, "GET", "/metrics").text
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert 'vllm:num_requests_running{model_name="moe"} 2' in text
