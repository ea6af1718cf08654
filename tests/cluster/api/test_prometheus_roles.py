"""The KV-transfer series on /metrics carry the replicas' role (prefill, decode, colocated), so
a dashboard splits a PD app's sides; every other series stays as it was (one per model)."""

from __future__ import annotations

from typing import Any

from fake_engine import FakeEngine
from test_prometheus import _FakeRayMetrics

from cluster.api.prometheus import RayMetricsExporter, parse_prometheus, render_prometheus
from cluster.api.replica_status import per_replica_metrics
from cluster.engine.metrics import Histogram


def _snap(engine: FakeEngine, replica: str, role: str | None, **numbers: Any) -> dict:
    seconds = Histogram((0.1, 1.0))
    for v in numbers.pop("seconds", ()):
        seconds.observe(v)
    snap = {**engine.metrics(), "replica_id": replica, "kv_transfer_seconds": seconds, **numbers}
    if role is not None:
        snap["kv_role"] = role
    return snap


def test_transfer_series_are_split_by_role(engine: FakeEngine) -> None:
    snaps = [_snap(engine, "p1", "prefill", kv_transfer_exports_total=3,
                   kv_transfer_bytes_out_total=3072, seconds=[0.05, 0.05, 0.5]),
             _snap(engine, "p2", "prefill", kv_transfer_exports_total=1,
                   kv_transfer_bytes_out_total=1024, seconds=[0.05]),
             _snap(engine, "d1", "decode", kv_transfer_imports_total=3,
                   kv_transfer_fallbacks_total=1, kv_transfer_bytes_in_total=3072,
                   seconds=[0.5, 2.0, 0.05]),
             _snap(engine, "c1", None)]
    text = render_prometheus(snaps, "m")
    m = parse_prometheus(text)
    pre, dec, col = ('model_name="m",role="prefill"', 'model_name="m",role="decode"',
                     'model_name="m",role="colocated"')
    assert m[f"qwen3_serve:kv_transfer_exports_total{{{pre}}}"] == 4  # summed per role
    assert m[f"qwen3_serve:kv_transfer_bytes_out_total{{{pre}}}"] == 4096
    assert m[f"qwen3_serve:kv_transfer_bytes_in_total{{{dec}}}"] == 3072
    assert m[f"qwen3_serve:kv_transfer_fallbacks_total{{{dec}}}"] == 1
    assert m[f"qwen3_serve:kv_transfer_fallbacks_total{{{pre}}}"] == 0
    assert m[f"qwen3_serve:kv_transfer_imports_total{{{col}}}"] == 0
    # the time histogram, one per role
    assert m[f"qwen3_serve:kv_transfer_seconds_count{{{pre}}}"] == 4
    assert m[f'qwen3_serve:kv_transfer_seconds_bucket{{{pre},le="0.1"}}'] == 3
    assert m[f'qwen3_serve:kv_transfer_seconds_bucket{{{dec},le="1.0"}}'] == 2
    assert m[f'qwen3_serve:kv_transfer_seconds_bucket{{{dec},le="+Inf"}}'] == 3
    assert m[f"qwen3_serve:kv_transfer_seconds_sum{{{dec}}}"] == 2.55
    assert m[f"qwen3_serve:kv_transfer_seconds_count{{{col}}}"] == 0
    assert text.count("# TYPE qwen3_serve:kv_transfer_seconds histogram") == 1
    # each replica's transfer series name its role; the others keep their labels
    assert m['qwen3_serve:replica_kv_transfer_bytes_in_total{model_name="m",replica="d1",'
             'role="decode"}'] == 3072
    assert m['qwen3_serve:replica_kv_transfer_bytes_out_total{model_name="m",replica="p2",'
             'role="prefill"}'] == 1024
    assert m['qwen3_serve:replica_prefix_cache_hits_total{model_name="m",replica="c1"}'] == 16
    assert m['vllm:prefix_cache_hits_total{model_name="m"}'] == 64
    assert not [k for k in m if "role=" in k and "kv_transfer" not in k]
    # ./dev status still reads every replica's numbers
    assert per_replica_metrics(text)["d1"]["kv_transfer_bytes_in"] == 3072
    assert per_replica_metrics(text)["p1"]["kv_transfer_bytes_out"] == 3072


def test_a_colocated_engine_renders_the_colocated_role(engine: FakeEngine) -> None:
    m = parse_prometheus(render_prometheus([engine.metrics()], "m"))
    assert m['qwen3_serve:kv_transfer_bytes_in_total{model_name="m",role="colocated"}'] == 0
    assert 'qwen3_serve:kv_transfer_bytes_in_total{model_name="m"}' not in m


def test_ray_export_tags_the_role(engine: FakeEngine) -> None:
    fake = _FakeRayMetrics()
    RayMetricsExporter("m", ray_metrics=fake, replica_id="r1", role="decode").update(
        engine.metrics())
    tags = {"model_name": "m", "replica": "r1", "role": "decode"}
    assert fake.made["qwen3_serve_kv_transfer_fallbacks"].tag_keys == tuple(tags)
    assert fake.made["vllm_num_requests_running"].calls == [("set", 2, tags)]
    assert all(set(c[2]) <= set(m.tag_keys) for m in fake.made.values() for c in m.calls)
