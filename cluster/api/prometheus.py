"""Engine metrics in Prometheus' text format (vLLM's names) and through `ray.util.metrics`.

`render_prometheus` turns engine `metrics()` snapshots (one per LLMServer replica) into the
text a Prometheus server scrapes from GET /metrics: counters and histograms are summed over
replicas, request gauges summed, and KV-cache usage averaged (it is a fraction per replica).
Counters follow the Prometheus convention vLLM uses: `# TYPE vllm:prompt_tokens counter`
with the sample `vllm:prompt_tokens_total`. The KV-transfer series (TRANSFER_COUNTERS, the
transfer-time histogram and the per-replica transfer series) carry the replicas' role,
`role="prefill" | "decode" | "colocated"` (a snapshot's `kv_role`), summed per role, so a
dashboard splits a PD app's two sides.

`RayMetricsExporter` pushes the same numbers into Ray's metrics agent from inside a replica,
so they reach Ray's dashboard and Prometheus tagged with the Serve replica's id (`replica`: one
series per replica for its KV usage, queue and running requests) and role (`role`), under the same names with
":" spelled "_" (Ray refuses colons; its exporter adds a `ray_` prefix, e.g.
`ray_vllm_num_requests_running`). Ray histograms only
take observations, so each bucket's new count is replayed as that many observations of the
bucket's upper bound: bucket counts are exact; Ray's `_sum` is an upper bound.
"""

from __future__ import annotations

import time
from typing import Any

# (snapshot key, exported name, help) for each kind.
GAUGES = (
    ("num_requests_running", "vllm:num_requests_running",
     "Number of requests in model execution batches."),
    ("num_requests_waiting", "vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    ("num_requests_swapped", "vllm:num_requests_swapped", "Number of requests swapped to CPU."),
    ("kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    ("kv_offload_usage_perc", "qwen3_serve:kv_offload_usage_perc",
     "CPU offload tier usage (kv_offloading_size). 1 means every tier block holds a prefix block."),
)
# Prefill/decode disaggregation's (cluster/engine/kv_transport.py KVTransferMetrics).
TRANSFER_COUNTERS = (
    ("kv_transfer_exports_total", "qwen3_serve:kv_transfer_exports",
     "Prompts whose KV a prefill replica handed over."),
    ("kv_transfer_imports_total", "qwen3_serve:kv_transfer_imports",
     "Prompts whose KV a decode replica received and cached."),
    ("kv_transfer_fallbacks_total", "qwen3_serve:kv_transfer_fallbacks",
     "Transfers that failed or passed their bound: the decode replica computed the prompt."),
    ("kv_transfer_bytes_out_total", "qwen3_serve:kv_transfer_bytes_out",
     "KV bytes a prefill replica handed over."),
    ("kv_transfer_bytes_in_total", "qwen3_serve:kv_transfer_bytes_in",
     "KV bytes a decode replica received."),
)
COUNTERS = (
    ("prefix_cache_queries", "vllm:prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "vllm:prefix_cache_hits",
     "Prefix cache hits, in terms of number of cached tokens."),
    ("external_prefix_cache_queries", "vllm:external_prefix_cache_queries",
     "External prefix cache queries from the CPU offload tier, in terms of number of queried "
     "tokens."),
    ("external_prefix_cache_hits", "vllm:external_prefix_cache_hits",
     "External prefix cache hits from the CPU offload tier, in terms of number of cached tokens."),
    ("kv_offload_blocks_offloaded", "qwen3_serve:kv_offload_blocks_offloaded",
     "KV blocks copied to the CPU offload tier when the GPU evicted them."),
    ("kv_offload_blocks_loaded", "qwen3_serve:kv_offload_blocks_loaded",
     "KV blocks loaded back from the CPU offload tier instead of recomputed."),
    ("prompt_tokens_total", "vllm:prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens_total", "vllm:generation_tokens", "Number of generation tokens processed."),
    ("num_preemptions_swap", "vllm:num_preemptions_swap",
     "Preemptions that swapped a request's KV blocks to CPU."),
    ("num_preemptions_recompute", "vllm:num_preemptions_recompute",
     "Preemptions that freed a request's KV blocks for recomputation."),
    ("num_worker_recoveries", "qwen3_serve:num_worker_recoveries",
     "Tensor-parallel groups rebuilt after a worker died (their requests recomputed)."),
    *TRANSFER_COUNTERS,
    ("spec_decode_num_drafts", "vllm:spec_decode_num_drafts",
     "Number of spec decoding drafts (verify rows with proposed tokens)."),
    ("spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens",
     "Number of draft tokens."),
    ("spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens",
     "Number of accepted tokens."),
)
PER_POS = ("vllm:spec_decode_num_accepted_tokens_per_pos",
           "Accepted tokens per draft position.")
HISTOGRAMS = (
    ("time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
     "Histogram of time to first token in seconds."),
    ("inter_token_latency_seconds", "vllm:inter_token_latency_seconds",
     "Histogram of inter-token latency in seconds."),
    ("e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds",
     "Histogram of end to end request latency in seconds."),
    ("request_queue_time_seconds", "vllm:request_queue_time_seconds",
     "Histogram of time spent in WAITING phase for request."),
    ("request_prefill_time_seconds", "vllm:request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request."),
    ("request_decode_time_seconds", "vllm:request_decode_time_seconds",
     "Histogram of time spent in DECODE phase for request."),
    ("request_inference_time_seconds", "vllm:request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request."),
    ("kv_transfer_seconds", "qwen3_serve:kv_transfer_seconds",
     "Histogram of KV transfer time (a prefill's copy out, a decode's fetch and write)."),
)
# Per replica (label `replica`, from snapshots that carry a `replica_id`): which replica hits.
PER_REPLICA = (
    ("prefix_cache_queries", "qwen3_serve:replica_prefix_cache_queries",
     "Prefix cache queries of one replica, in tokens."),
    ("prefix_cache_hits", "qwen3_serve:replica_prefix_cache_hits",
     "Prefix cache hits of one replica, in tokens."),
    ("num_requests_running", "qwen3_serve:replica_num_requests_running",
     "Requests in one replica's model execution batches."),
    ("num_requests_waiting", "qwen3_serve:replica_num_requests_waiting",
     "Requests waiting in one replica's queue."),
    ("kv_cache_usage_perc", "qwen3_serve:replica_kv_cache_usage_perc",
     "One replica's KV-cache usage. 1 means 100 percent usage."),
    ("kv_transfer_bytes_out_total", "qwen3_serve:replica_kv_transfer_bytes_out",
     "KV bytes one prefill replica handed over."),
    ("kv_transfer_bytes_in_total", "qwen3_serve:replica_kv_transfer_bytes_in",
     "KV bytes one decode replica received."),
    ("kv_transfer_fallbacks_total", "qwen3_serve:replica_kv_transfer_fallbacks",
     "Transfers one decode replica gave up on (it computed the prompt)."),
)
_GAUGE_KEYS = {key for key, _, _ in GAUGES}
# The series labelled with the replicas' role.
_ROLE_KEYS = {key for key, _, _ in TRANSFER_COUNTERS} | {"kv_transfer_seconds"}
# LoRA (snapshots with `max_lora` > 0, cluster/engine/lora.py `lora_metrics`): vLLM's info gauge,
# set to the scrape time, its labels the adapters of running and of waiting requests (comma
# separated, over every replica) and the device slots; and requests per adapter.
LORA_INFO = ("vllm:lora_requests_info", "Running stats on lora requests.")
LORA_REQUESTS = ("qwen3_serve:lora_requests", "Requests admitted per LoRA adapter.")
LORA_LOADED = ("qwen3_serve:replica_lora_loaded",
               "1 for each LoRA adapter a replica has loaded (label lora_name).")
PREEMPTIONS = ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.")
SUCCESS = ("vllm:request_success", "Count of successfully processed requests.")


def merge_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot for the whole deployment (see the module docstring for how)."""
    if not snapshots:
        raise ValueError("no engine metrics to merge: no LLMServer replica answered")
    merged: dict[str, Any] = {}
    for key, _, _ in GAUGES + COUNTERS:
        merged[key] = sum(s[key] for s in snapshots)
    merged["kv_cache_usage_perc"] /= len(snapshots)
    merged["kv_offload_usage_perc"] /= len(snapshots)
    success: dict[str, int] = {}
    for s in snapshots:
        for reason, n in s["request_success_total"].items():
            success[reason] = success.get(reason, 0) + n
    merged["request_success_total"] = success
    per_pos: list[int] = []
    for s in snapshots:
        lst = s["spec_decode_num_accepted_tokens_per_pos"]
        per_pos += [0] * (len(lst) - len(per_pos))
        per_pos = [a + b for a, b in zip(per_pos, lst + [0] * (len(per_pos) - len(lst)))]
    merged["spec_decode_num_accepted_tokens_per_pos"] = per_pos
    for key, _, _ in HISTOGRAMS:
        merged[key] = _merge_hists(key, [s[key] for s in snapshots])
    return merged


def _merge_hists(key: str, hists: list[Any]) -> _Hist:
    buckets = tuple(hists[0].buckets)
    if any(tuple(h.buckets) != buckets for h in hists):
        raise ValueError(f"replicas disagree on {key} buckets; they run different versions")
    counts = [sum(c) for c in zip(*(h.counts for h in hists))]
    return _Hist(buckets, counts, sum(h.sum for h in hists), sum(h.count for h in hists))


def role_of(snapshot: dict[str, Any]) -> str:
    """A replica's role label: its engine's `kv_role`, "colocated" without one."""
    return snapshot.get("kv_role") or "colocated"


def _by_role(snapshots: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    roles: dict[str, list[dict[str, Any]]] = {}
    for s in snapshots:
        roles.setdefault(role_of(s), []).append(s)
    return sorted(roles.items())


class _Hist:
    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: tuple[float, ...], counts: list[int], total: float,
                 count: int) -> None:
        self.buckets, self.counts, self.sum, self.count = buckets, counts, total, count


def render_prometheus(snapshots: list[dict[str, Any]], model_name: str) -> str:
    """Prometheus text exposition (format 0.0.4) of the merged snapshots."""
    m = merge_snapshots(snapshots)
    label = f'model_name="{_escape(model_name)}"'
    roles = [(f'{label},role="{_escape(role)}"', group) for role, group in _by_role(snapshots)]
    lines: list[str] = []

    def header(name: str, help_text: str, kind: str) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")

    for key, name, help_text in GAUGES:
        header(name, help_text, "gauge")
        lines.append(f"{name}{{{label}}} {_num(m[key])}")
    for key, name, help_text in COUNTERS:
        header(name, help_text, "counter")
        if key in _ROLE_KEYS:
            lines += [f"{name}_total{{{labels}}} {_num(sum(s[key] for s in group))}"
                      for labels, group in roles]
        else:
            lines.append(f"{name}_total{{{label}}} {_num(m[key])}")
    header(*PREEMPTIONS, "counter")
    preemptions = m["num_preemptions_swap"] + m["num_preemptions_recompute"]
    lines.append(f"{PREEMPTIONS[0]}_total{{{label}}} {preemptions}")
    header(*SUCCESS, "counter")
    for reason, n in sorted(m["request_success_total"].items()):
        lines.append(f'{SUCCESS[0]}_total{{{label},finished_reason="{reason}"}} {n}')
    if m["spec_decode_num_accepted_tokens_per_pos"]:
        header(*PER_POS, "counter")
        for pos, n in enumerate(m["spec_decode_num_accepted_tokens_per_pos"]):
            lines.append(f'{PER_POS[0]}_total{{{label},position="{pos}"}} {n}')
    for key, name, help_text in HISTOGRAMS:
        header(name, help_text, "histogram")
        if key in _ROLE_KEYS:
            for labels, group in roles:
                lines += _histogram_lines(name, _merge_hists(key, [s[key] for s in group]),
                                          labels)
        else:
            lines += _histogram_lines(name, m[key], label)
    lines += _lora_lines([s for s in snapshots if s.get("max_lora")], label)
    replicas = sorted((s["replica_id"], s) for s in snapshots if s.get("replica_id"))
    for key, name, help_text in PER_REPLICA if replicas else ():
        kind = "gauge" if key in _GAUGE_KEYS else "counter"
        header(name, help_text, kind)
        suffix = "_total" if kind == "counter" else ""
        for rid, s in replicas:
            role = f',role="{_escape(role_of(s))}"' if key in _ROLE_KEYS else ""
            lines.append(f'{name}{suffix}{{{label},replica="{_escape(rid)}"{role}}} '
                         f'{_num(s[key])}')
    return "\n".join(lines) + "\n"


def _histogram_lines(name: str, h: Any, label: str) -> list[str]:
    lines, cumulative = [], 0
    for bound, c in zip(h.buckets, h.counts):
        cumulative += c
        lines.append(f'{name}_bucket{{{label},le="{_num(float(bound))}"}} {cumulative}')
    lines.append(f'{name}_bucket{{{label},le="+Inf"}} {h.count}')
    lines.append(f"{name}_sum{{{label}}} {_num(h.sum)}")
    lines.append(f"{name}_count{{{label}}} {h.count}")
    return lines


def _lora_lines(snapshots: list[dict[str, Any]], label: str) -> list[str]:
    """LORA_INFO and LORA_REQUESTS over the replicas that run LoRA (none: no lines)."""
    if not snapshots:
        return []
    running = sorted({n for s in snapshots for n in s["lora_running"]})
    waiting = sorted({n for s in snapshots for n in s["lora_waiting"]})
    counts: dict[str, int] = {}
    for s in snapshots:
        for name, n in s["lora_requests_total"].items():
            counts[name] = counts.get(name, 0) + n
    info = (f'{label},max_lora="{max(s["max_lora"] for s in snapshots)}",'
            f'running_lora_adapters="{_escape(",".join(running))}",'
            f'waiting_lora_adapters="{_escape(",".join(waiting))}"')
    lines = [f"# HELP {LORA_INFO[0]} {LORA_INFO[1]}", f"# TYPE {LORA_INFO[0]} gauge",
             f"{LORA_INFO[0]}{{{info}}} {_num(time.time())}",
             f"# HELP {LORA_REQUESTS[0]} {LORA_REQUESTS[1]}", f"# TYPE {LORA_REQUESTS[0]} counter"]
    lines += [f'{LORA_REQUESTS[0]}_total{{{label},lora_name="{_escape(name)}"}} {n}'
              for name, n in sorted(counts.items())]
    lines += [f"# HELP {LORA_LOADED[0]} {LORA_LOADED[1]}", f"# TYPE {LORA_LOADED[0]} gauge"]
    lines += [f'{LORA_LOADED[0]}{{{label},replica="{_escape(s["replica_id"])}",'
              f'lora_name="{_escape(name)}"}} 1'
              for s in snapshots if s.get("replica_id") for name in s["lora_loaded"]]
    return lines


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name with labels -> value, e.g. {'vllm:num_requests_running{model_name="m"}': 0.0}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _num(x: float | int) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class RayMetricsExporter:
    """Mirrors one engine's snapshots into `ray.util.metrics` (call `update` periodically)."""

    def __init__(self, model_name: str, ray_metrics: Any = None,
                 replica_id: str | None = None, role: str | None = None) -> None:
        if ray_metrics is None:  # tests pass a stand-in with Gauge/Counter/Histogram
            from ray.util import metrics as ray_metrics

        self._tags = {"model_name": model_name}
        if replica_id is not None:
            self._tags["replica"] = replica_id
        if role is not None:  # the engine's kv_role, "colocated" without one
            self._tags["role"] = role
        tags = tuple(self._tags)

        def ray_name(name: str) -> str:
            return name.replace(":", "_")

        self._gauges = {key: ray_metrics.Gauge(ray_name(name), help_text, tag_keys=tags)
                        for key, name, help_text in GAUGES}
        self._counters = {key: ray_metrics.Counter(ray_name(name), help_text, tag_keys=tags)
                          for key, name, help_text in COUNTERS}
        self._success = ray_metrics.Counter(ray_name(SUCCESS[0]), SUCCESS[1],
                                            tag_keys=tags + ("finished_reason",))
        self._per_pos = ray_metrics.Counter(ray_name(PER_POS[0]), PER_POS[1],
                                            tag_keys=tags + ("position",))
        self._histograms: dict[str, Any] = {}
        self._ray_name = ray_name
        self._ray_metrics = ray_metrics
        self._last: dict[str, Any] = {}

    def update(self, snapshot: dict[str, Any]) -> None:
        for key, gauge in self._gauges.items():
            gauge.set(snapshot[key], tags=self._tags)
        for key, counter in self._counters.items():
            delta = snapshot[key] - self._last.get(key, 0)
            if delta > 0:
                counter.inc(delta, tags=self._tags)
            self._last[key] = snapshot[key]
        for reason, n in snapshot["request_success_total"].items():
            key = f"success:{reason}"
            delta = n - self._last.get(key, 0)
            if delta > 0:
                self._success.inc(delta, tags={**self._tags, "finished_reason": reason})
            self._last[key] = n
        for pos, n in enumerate(snapshot["spec_decode_num_accepted_tokens_per_pos"]):
            key = f"per_pos:{pos}"
            delta = n - self._last.get(key, 0)
            if delta > 0:
                self._per_pos.inc(delta, tags={**self._tags, "position": str(pos)})
            self._last[key] = n
        for key, name, help_text in HISTOGRAMS:
            h = snapshot[key]
            if key not in self._histograms:
                self._histograms[key] = self._ray_metrics.Histogram(
                    self._ray_name(name), help_text, boundaries=list(h.buckets), tag_keys=tuple(self._tags))
            last = self._last.get(key) or [0] * len(h.counts)
            # +Inf observations are replayed just past the last bound.
            bounds = list(h.buckets) + [h.buckets[-1] * 2]
            for bound, now, before in zip(bounds, h.counts, last):
                for _ in range(now - before):
                    self._histograms[key].observe(bound, tags=self._tags)
            self._last[key] = list(h.counts)
