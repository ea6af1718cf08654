"""deploy/: what can be checked without a Kubernetes cluster, a registry or a GPU.

The RayService against the RayService schema kept in deploy/schema/ (KubeRay 1.4's fields, no
unknown key), its pod templates against Kubernetes' own schemas (kubernetes-validate), its
serveConfigV2 through the checks `./dev serve` runs before starting Ray, the Ray version of the
image, the manifest and the project, and every Grafana query's metric and label names against
what a real engine's /metrics exposes.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.33"


def _rayservice() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())


def _schema_errors(doc: dict[str, Any]) -> list[str]:
    schema = json.loads((DEPLOY / "schema" / "rayservice.v1.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def _pod_templates(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = doc["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    out.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return out


def _validate_pod_template(name: str, template: dict[str, Any]) -> None:
    resource = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                "template": template}
    kubernetes_validate.validate(resource, K8S_VERSION, strict=True)


def test_rayservice_has_the_schemas_fields_and_no_unknown_key() -> None:
    doc = _rayservice()
    assert _schema_errors(doc) == []
    workers = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert [g["groupName"] for g in workers] == ["gpu-tp2"]
    assert doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"


def test_schema_rejects_a_misspelt_key_and_a_missing_template() -> None:
    doc = _rayservice()
    typo = copy.deepcopy(doc)
    typo["spec"]["rayClusterConfig"]["workerGroupSpec"] = typo["spec"]["rayClusterConfig"].pop(
        "workerGroupSpecs")
    assert any("workerGroupSpec" in e for e in _schema_errors(typo))
    missing = copy.deepcopy(doc)
    del missing["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]
    assert any("'template' is a required property" in e for e in _schema_errors(missing))
    bad_upgrade = copy.deepcopy(doc)
    bad_upgrade["spec"]["upgradeStrategy"]["type"] = "Rolling"
    assert any("upgradeStrategy" in e for e in _schema_errors(bad_upgrade))


def test_pod_templates_are_valid_kubernetes() -> None:
    templates = _pod_templates(_rayservice())
    for name, template in templates.items():
        _validate_pod_template(name, template)
    gpus = templates["gpu-tp2"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) == 2  # one replica = one tensor-parallel group of 2 on one node


def test_kubernetes_schema_rejects_a_bad_pod_template() -> None:
    template = copy.deepcopy(_pod_templates(_rayservice())["gpu-tp2"])
    template["spec"]["containers"][0]["volumeMounts"][0]["mountPath"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_pod_template("bad", template)
    template = copy.deepcopy(_pod_templates(_rayservice())["head"])
    template["spec"]["containers"][0]["portz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_pod_template("bad", template)


def _serve_run() -> Any:
    spec = importlib.util.spec_from_file_location("serve_run", ROOT / "scripts" / "serve_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_config_passes_dev_serves_checks_with_the_manifests_keys() -> None:
    serve_run = _serve_run()
    config = yaml.safe_load(_rayservice()["spec"]["serveConfigV2"])
    serve_run.check_manifest("deploy/rayservice.yaml serveConfigV2", config)
    app = config["applications"][0]
    manifest = yaml.safe_load((ROOT / "manifests" / "qwen3-tp2.yaml").read_text())
    tp2 = manifest["applications"][0]
    assert app["import_path"] == tp2["import_path"]
    assert app["args"]["tensor_parallel_size"] == tp2["args"]["tensor_parallel_size"] == 2
    broken = copy.deepcopy(config)
    broken["applications"][0]["args"]["tensor_paralel_size"] = 2
    with pytest.raises(serve_run.ManifestError, match="tensor_paralel_size"):
        serve_run.check_manifest("deploy/rayservice.yaml serveConfigV2", broken)


def test_image_manifest_and_project_agree_on_ray() -> None:
    import ray

    dockerfile = (DEPLOY / "Dockerfile").read_text()
    image = re.search(r"^ARG RAY_IMAGE=rayproject/ray:([\d.]+)-", dockerfile, re.M)
    assert image is not None
    ray_version = _rayservice()["spec"]["rayClusterConfig"]["rayVersion"]
    assert image.group(1) == ray_version == ray.__version__
    pin = re.search(r'"ray\[[\w,]*serve[\w,]*\]>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin is not None and ray_version.startswith(pin.group(1))


def test_dockerfile_copies_every_package_the_project_installs() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    copied = {m.group(1) for m in re.finditer(r"^COPY \S+ (\w+) \./", dockerfile, re.M)}
    packages = set(re.search(r'include = \[([^\]]*)\]', (ROOT / "pyproject.toml").read_text())
                   .group(1).replace('"', "").replace("*", "").replace(" ", "").split(","))
    assert packages == {"cluster", "workers", "kernels", "kvcache", "scheduler"}
    assert packages <= copied
    assert all((ROOT / p).is_dir() for p in copied)


@pytest.fixture(scope="module")
def exposed(tiny_model_path: str) -> dict[str, float]:
    """A real engine's /metrics text, as the ingress renders it for two replicas."""
    from cluster import LLM, SamplingParams
    from cluster.api.prometheus import parse_prometheus, render_prometheus

    with LLM(tiny_model_path) as llm:
        llm.generate(["Hello there", "The capital of France is"],
                     SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        snapshot = llm.engine.metrics()
    snapshots = [{**snapshot, "replica_id": r} for r in ("replica-a", "replica-b")]
    return parse_prometheus(render_prometheus(snapshots, "qwen3"))


def test_every_dashboard_query_names_exported_metrics_and_labels(
        exposed: dict[str, float]) -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "qwen3-serve.json").read_text())
    names = {key.split("{")[0] for key in exposed}
    labels = {m.group(1) for key in exposed for m in re.finditer(r'(\w+)="', key)}
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 20
    used = set()
    for expr in exprs:
        metrics = re.findall(r"(?:vllm|qwen3_serve):\w+", expr)
        assert metrics, expr
        assert set(metrics) <= names, (expr, set(metrics) - names)
        used |= set(metrics)
        grouped = re.findall(r"by \(([\w, ]+)\)", expr) + re.findall(r"\{\{(\w+)\}\}", expr)
        for group in grouped:
            assert {g.strip() for g in group.split(",")} <= labels | {"le"}, expr
    for legend in (t["legendFormat"] for p in dashboard["panels"] for t in p["targets"]):
        assert set(re.findall(r"\{\{(\w+)\}\}", legend)) <= labels, legend
    # the list: requests, tokens, TTFT/TPOT, KV usage per replica
    assert {"vllm:request_success_total", "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
            "qwen3_serve:replica_kv_cache_usage_perc"} <= used
    query = dashboard["templating"]["list"][1]["query"]
    assert re.search(r"label_values\((\S+), model_name\)", query).group(1) in names
