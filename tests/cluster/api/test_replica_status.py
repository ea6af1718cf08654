"""`./dev status`'s table: Serve's replica details joined with the engine's per-replica series of
GET /metrics (rendered by the same code the ingress serves them with)."""

from __future__ import annotations

from fake_engine import FakeEngine

from cluster.api.prometheus import render_prometheus
from cluster.api.replica_status import (
    format_table,
    loaded_adapters,
    metrics_url,
    per_replica_metrics,
    replica_rows,
)


def _replica(rid: str, state: str = "RUNNING", pid: int | None = 100) -> dict:
    # the fields of Serve's ReplicaDetails this view reads, as the dashboard returns them
    return {"replica_id": rid, "state": state, "pid": pid, "node_ip": "10.0.0.2",
            "node_id": "ab" * 28, "actor_name": f"SERVE_REPLICA::qwen3#LLMServer#{rid}",
            "start_time_s": 1.0}


DETAILS = {
    "http_options": {"host": "0.0.0.0", "port": 8411},
    "applications": {"qwen3": {"deployments": {
        "LLMServer": {"replicas": [_replica("r-b"), _replica("r-a"),
                                   _replica("r-c", "STARTING", None)]},
        "OpenAIIngress": {"replicas": [_replica("i-1")]},
    }}},
}


def _metrics(engine: FakeEngine) -> str:
    a = {**engine.metrics(), "replica_id": "r-a", "num_requests_waiting": 3,
         "kv_cache_usage_perc": 0.625, "prefix_cache_queries": 200, "prefix_cache_hits": 50,
         "kv_transfer_bytes_in_total": 3 * 2**20, "kv_transfer_fallbacks_total": 1}
    b = {**engine.metrics(), "replica_id": "r-b", "num_requests_running": 7,
         "prefix_cache_queries": 0, "prefix_cache_hits": 0}
    return render_prometheus([b, a], "qwen3-tiny")


def test_per_replica_series_are_read_back_from_the_rendered_text(engine: FakeEngine) -> None:
    m = per_replica_metrics(_metrics(engine))
    assert m["r-a"] == {"prefix_cache_queries": 200.0, "prefix_cache_hits": 50.0,
                        "num_requests_running": 2.0, "num_requests_waiting": 3.0,
                        "kv_cache_usage_perc": 0.625, "kv_transfer_bytes_out": 0.0,
                        "kv_transfer_bytes_in": 3.0 * 2**20, "kv_transfer_fallbacks": 1.0}
    assert m["r-b"]["num_requests_running"] == 7.0
    assert per_replica_metrics('qwen3_serve:replica_num_requests_running{model_name="m",'
                               'replica="x\\"y"} 4') == {'x"y': {"num_requests_running": 4.0}}


def test_rows_join_serve_states_with_engine_numbers(engine: FakeEngine) -> None:
    rows = replica_rows(DETAILS, _metrics(engine))
    by_id = {r["replica"]: r for r in rows}
    assert [r["replica"] for r in rows] == ["r-a", "r-b", "r-c", "i-1"]
    assert by_id["r-a"] == {"app": "qwen3", "deployment": "LLMServer", "role": "-",
                            "replica": "r-a", "state": "RUNNING", "node": "10.0.0.2",
                            "pid": "100", "running": "2", "waiting": "3", "kv_usage": "62.5%",
                            "prefix_hit": "25.0%", "kv_moved": "3.0MiB", "fallbacks": "1",
                            "loras": "-"}
    # no prefix query yet: no hit rate rather than 0 %
    assert (by_id["r-b"]["running"], by_id["r-b"]["prefix_hit"]) == ("7", "-")
    # a replica that is not serving yet, and the ingress, have no engine numbers
    assert [by_id["r-c"][c] for c in ("state", "pid", "running", "kv_usage")] == [
        "STARTING", "-", "-", "-"]
    assert by_id["i-1"]["deployment"] == "OpenAIIngress" and by_id["i-1"]["waiting"] == "-"


def test_table_has_a_header_and_aligned_columns(engine: FakeEngine) -> None:
    lines = format_table(replica_rows(DETAILS, _metrics(engine))).splitlines()
    assert lines[0].split() == ["APP", "DEPLOYMENT", "ROLE", "REPLICA", "STATE", "NODE", "PID",
                                "RUNNING", "WAITING", "KV_USAGE", "PREFIX_HIT", "KV_MOVED",
                                "FALLBACKS", "LORAS"]
    assert lines[1].split() == ["qwen3", "LLMServer", "-", "r-a", "RUNNING", "10.0.0.2",
                                "100", "2", "3", "62.5%", "25.0%", "3.0MiB", "1", "-"]
    start = lines[0].index("KV_USAGE")
    assert all(line[start:].split()[0] in ("KV_USAGE", "62.5%", "25.0%", "-")
               for line in lines)


def test_a_pd_apps_replicas_show_their_role(engine: FakeEngine) -> None:
    details = {"applications": {"qwen3": {"deployments": {
        "LLMServer-prefill": {"replicas": [_replica("r-a")]},
        "LLMServer-decode": {"replicas": [_replica("r-b")]}}}}}
    by_id = {r["replica"]: r for r in replica_rows(details, _metrics(engine))}
    assert (by_id["r-a"]["role"], by_id["r-b"]["role"]) == ("prefill", "decode")
    assert (by_id["r-a"]["kv_moved"], by_id["r-b"]["kv_moved"]) == ("3.0MiB", "0KiB")


def test_metrics_url_reaches_a_wildcard_host_on_the_loopback() -> None:
    assert metrics_url(DETAILS) == "http://127.0.0.1:8411/metrics"
    assert metrics_url({"http_options": {"host": "10.1.2.3", "port": 9}}) == \
        "http://10.1.2.3:9/metrics"


def _lora_snapshot(engine: FakeEngine, rid: str, loaded: list[str], running: list[str],
                   waiting: list[str], counts: dict[str, int]) -> dict:
    return {**engine.metrics(), "replica_id": rid, "max_lora": 4, "lora_loaded": loaded,
            "lora_running": running, "lora_waiting": waiting, "lora_requests_total": counts}


def test_each_replica_lists_the_lora_adapters_it_has_loaded(engine: FakeEngine) -> None:
    text = render_prometheus([
        _lora_snapshot(engine, "r-a", ["sql", "chat"], ["sql"], [], {"sql": 3}),
        _lora_snapshot(engine, "r-b", ["sql"], [], ["sql"], {"sql": 1}),
        {**engine.metrics(), "replica_id": "r-c"}], "qwen3-tiny")
    assert loaded_adapters(text) == {"r-a": ["sql", "chat"], "r-b": ["sql"]}
    by_id = {r["replica"]: r for r in replica_rows(DETAILS, text)}
    assert (by_id["r-a"]["loras"], by_id["r-b"]["loras"], by_id["r-c"]["loras"]) == (
        "sql,chat", "sql", "-")
    assert per_replica_metrics(text)["r-a"]["num_requests_running"] == 2.0
