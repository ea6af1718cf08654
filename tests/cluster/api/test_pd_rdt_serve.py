"""A PD app over Serve whose KV moves by Ray Direct Transport (`kv_transport: rdt`, gloo on
CPU, each role's tp 1 rank a Ray actor): the prefill replica's handle crosses to the decode
replica through Serve, the decode replica pairs its rank with the prefill rank and pulls the
payload; the completion equals the colocated engine's, and /metrics shows the transfer under
the decode role."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from serve_apps import serve_app

from cluster.api.prometheus import parse_prometheus

pytestmark = pytest.mark.slow

MANIFEST = Path(__file__).resolve().parents[3] / "manifests" / "qwen3-pd.yaml"
APP = "qwen3-pd-rdt"
PROMPT = "The capital of France is a city that " * 4  # several full blocks of 16 tokens
GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def base_url(ray_cluster: None) -> Iterator[str]:
    args = dict(yaml.safe_load(MANIFEST.read_text())["applications"][0]["args"])
    args.update(executor="ray", kv_transport="rdt", worker_num_cpus=0.2)
    with serve_app(args, APP) as url:
        yield url


def test_rdt_completion_equals_colocated_and_is_counted_under_decode(base_url: str) -> None:
    from cluster import LLM, SamplingParams

    llm = LLM("qwen3-tiny", tensor_parallel_size=1)
    try:
        want = llm.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": PROMPT, **GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    m = parse_prometheus(httpx.get(f"{base_url}/metrics", timeout=60).text)
    label = next(k for k in m if k.startswith("qwen3_serve:kv_transfer_imports_total{"))
    label = label[label.index("{") + 1:label.index(",role=")]
    assert m[f'qwen3_serve:kv_transfer_imports_total{{{label},role="decode"}}'] == 1
    assert m[f'qwen3_serve:kv_transfer_fallbacks_total{{{label},role="decode"}}'] == 0
    assert m[f'qwen3_serve:kv_transfer_exports_total{{{label},role="prefill"}}'] == 1
    assert m[f'qwen3_serve:kv_transfer_bytes_in_total{{{label},role="decode"}}'] == \
        m[f'qwen3_serve:kv_transfer_bytes_out_total{{{label},role="prefill"}}'] > 0
