"""Engine metrics as Prometheus text on GET /metrics (vLLM's names, summed over replicas) and
through Ray's metrics agent, over the fake engine's fixed snapshot (fake_engine.py).
"""

from __future__ import annotations

from typing import Any

from fake_engine import FakeEngine, fetch

from cluster.api.prometheus import parse_prometheus, render_prometheus


def test_metrics_render_vllm_names_in_prometheus_format(engine: FakeEngine,
                                                        tokenizer: Any) -> None:
    resp = fetch(engine, tokenizer, "GET", "/metrics")
    assert resp.status_code == 200
    m = parse_prometheus(resp.text)
    label = 'model_name="fake-qwen3"'
    assert m[f"vllm:num_requests_running{{{label}}}"] == 2
    assert m[f"vllm:num_requests_waiting{{{label}}}"] == 1
    assert m[f"vllm:kv_cache_usage_perc{{{label}}}"] == 0.25
    assert m[f"vllm:prefix_cache_queries_total{{{label}}}"] == 40
    assert m[f"vllm:prefix_cache_hits_total{{{label}}}"] == 16
    assert m[f"vllm:external_prefix_cache_queries_total{{{label}}}"] == 24
    assert m[f"vllm:external_prefix_cache_hits_total{{{label}}}"] == 8
    assert m[f"qwen3_serve:kv_offload_blocks_offloaded_total{{{label}}}"] == 5
    assert m[f"qwen3_serve:kv_offload_blocks_loaded_total{{{label}}}"] == 2
    assert m[f"qwen3_serve:kv_offload_usage_perc{{{label}}}"] == 0.5
    assert m[f"vllm:prompt_tokens_total{{{label}}}"] == 40
    assert m[f"vllm:generation_tokens_total{{{label}}}"] == 7
    assert m[f"vllm:num_preemptions_total{{{label}}}"] == 3
    assert m[f"vllm:num_preemptions_swap_total{{{label}}}"] == 1
    assert m[f'vllm:request_success_total{{{label},finished_reason="length"}}'] == 2
    assert m[f"vllm:spec_decode_num_drafts_total{{{label}}}"] == 3
    assert m[f"vllm:spec_decode_num_draft_tokens_total{{{label}}}"] == 9
    assert m[f"vllm:spec_decode_num_accepted_tokens_total{{{label}}}"] == 5
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [m[f'{per_pos}{{{label},position="{i}"}}'] for i in range(3)] == [3, 2, 0]
    ttft = "vllm:time_to_first_token_seconds"
    assert [m[f'{ttft}_bucket{{{label},le="{le}"}}'] for le in ("0.1", "1.0", "+Inf")] == [1, 2, 3]
    assert (m[f"{ttft}_sum{{{label}}}"], m[f"{ttft}_count{{{label}}}"]) == (3.55, 3)
    assert "# TYPE vllm:prompt_tokens counter" in resp.text
    assert "# TYPE vllm:inter_token_latency_seconds histogram" in resp.text


def test_request_phase_histograms_follow_vllms_definitions() -> None:
    from cluster.engine.metrics import LatencyMetrics, RequestTimes

    lat = LatencyMetrics()
    t = RequestTimes(arrival=10.0, scheduled=10.5)
    lat.on_tokens(t, 11.0, 1)
    lat.on_tokens(t, 13.0, 2)
    lat.on_finished(t, 13.0, "length")
    assert [(h.sum, h.count) for h in (lat.queue, lat.prefill, lat.decode, lat.inference)] == [
        (0.5, 1), (0.5, 1), (2.0, 1), (2.5, 1)]
    never_ran = RequestTimes(arrival=10.0)
    lat.on_finished(never_ran, 12.0, "abort")  # aborted while waiting: no phase to observe
    assert lat.queue.count == 1 and lat.e2e.count == 2


def test_phase_histograms_and_per_replica_series_in_one_view(engine: FakeEngine) -> None:
    snaps = [{**engine.metrics(), "replica_id": "r-b"}, {**engine.metrics(), "replica_id": "r-a",
                                                         "prefix_cache_hits": 30}]
    text = render_prometheus(snaps, "m")
    m = parse_prometheus(text)
    assert m['vllm:request_queue_time_seconds_count{model_name="m"}'] == 2
    assert m['vllm:request_queue_time_seconds_bucket{model_name="m",le="0.3"}'] == 2
    assert "# TYPE vllm:request_inference_time_seconds histogram" in text
    assert m['vllm:prefix_cache_hits_total{model_name="m"}'] == 46  # merged
    assert m['qwen3_serve:replica_prefix_cache_hits_total{model_name="m",replica="r-a"}'] == 30
    assert m['qwen3_serve:replica_prefix_cache_hits_total{model_name="m",replica="r-b"}'] == 16
    assert m['qwen3_serve:replica_num_requests_running{model_name="m",replica="r-a"}'] == 2
    # An engine in this process (no replica id) renders no per-replica series.
    assert "replica=" not in render_prometheus([engine.metrics()], "m")


def test_metrics_of_two_replicas_are_summed(engine: FakeEngine) -> None:
    m = parse_prometheus(render_prometheus([engine.metrics(), engine.metrics()], "m"))
    assert m['vllm:num_requests_running{model_name="m"}'] == 4
    assert m['vllm:kv_cache_usage_perc{model_name="m"}'] == 0.25
    assert m['qwen3_serve:kv_offload_usage_perc{model_name="m"}'] == 0.5
    assert m['vllm:external_prefix_cache_hits_total{model_name="m"}'] == 16
    assert m['vllm:time_to_first_token_seconds_count{model_name="m"}'] == 6
    assert m['vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"}'] == 4


class _FakeRayMetric:
    def __init__(self, name: str, description: str = "", tag_keys: tuple = (),
                 boundaries: list[float] | None = None) -> None:
        self.name, self.boundaries, self.tag_keys = name, boundaries, tag_keys
        self.calls: list[tuple[str, float, dict[str, str]]] = []

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("set", value, tags))

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("inc", value, tags))

    def observe(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("observe", value, tags))


class _FakeRayMetrics:
    def __init__(self) -> None:
        self.made: dict[str, _FakeRayMetric] = {}

    def _make(self, name: str, *args: Any, **kw: Any) -> _FakeRayMetric:
        self.made[name] = _FakeRayMetric(name, *args, **kw)
        return self.made[name]

    Gauge = Counter = Histogram = _make


def test_ray_export_sends_counter_deltas_and_replays_histogram_buckets(
        engine: FakeEngine) -> None:
    from cluster.api.prometheus import RayMetricsExporter

    fake = _FakeRayMetrics()
    exporter = RayMetricsExporter("m", ray_metrics=fake)
    snap = engine.metrics()
    exporter.update(snap)
    snap["prompt_tokens_total"] = 45
    snap["time_to_first_token_seconds"].observe(0.07)
    exporter.update(snap)
    tags = {"model_name": "m"}
    assert fake.made["vllm_prompt_tokens"].calls == [("inc", 40, tags), ("inc", 5, tags)]
    assert fake.made["vllm_num_requests_running"].calls == [("set", 2, tags)] * 2
    ttft = fake.made["vllm_time_to_first_token_seconds"]
    assert ttft.boundaries == [0.1, 1.0]
    # 0.05 -> le 0.1, 0.5 -> le 1.0, 3.0 -> +Inf (replayed at 2.0), then the new 0.07.
    assert [c[1] for c in ttft.calls] == [0.1, 1.0, 2.0, 0.1]
    assert fake.made["vllm_request_success"].calls == [
        ("inc", 1, {**tags, "finished_reason": "stop"}),
        ("inc", 2, {**tags, "finished_reason": "length"})]


def test_ray_export_tags_every_series_with_the_replica_when_given(engine: FakeEngine) -> None:
    from cluster.api.prometheus import RayMetricsExporter

    fake = _FakeRayMetrics()
    RayMetricsExporter("m", ray_metrics=fake, replica_id="r1").update(engine.metrics())
    tags = {"model_name": "m", "replica": "r1"}
    assert fake.made["vllm_kv_cache_usage_perc"].calls[0][2] == tags
    assert fake.made["vllm_num_requests_waiting"].calls[0][2] == tags
    assert fake.made["vllm_num_requests_running"].calls == [("set", 2, tags)]
    assert {c[2]["replica"] for m in fake.made.values() for c in m.calls} == {"r1"}
    # Ray refuses a tag its metric was not declared with
    assert all(set(c[2]) <= set(m.tag_keys) for m in fake.made.values() for c in m.calls)
