"""`./dev status`: one line per Serve replica — its state, node and, for LLMServer replicas, the
engine's running and waiting requests, KV-cache usage and prefix-cache hit rate.

For an engine with LoRA on, the `loras` column lists the adapters the replica has loaded
(`qwen3_serve:replica_lora_loaded`).

`serve status` counts replicas per state; it has no per-replica numbers, and Serve offers a
deployment no way to add them. This view joins two things the cluster already serves:
Serve's own details (the dashboard's `/api/serve/applications/`, read with the client that
`serve status` uses, so the same address, `RAY_DASHBOARD_ADDRESS`, and token authentication
apply) and the app's GET /metrics, whose `qwen3_serve:replica_*` series carry each LLMServer
replica's id in the label `replica` (cluster/api/prometheus.py). The numbers are as fresh as
one /metrics answer (each replica's snapshot at that moment); a replica that is not RUNNING
has none (shown as "-"), and a /metrics that cannot be read leaves only Serve's columns, with
the reason on stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

import httpx

# Per-replica series of GET /metrics -> column (cluster/api/prometheus.py PER_REPLICA).
_SERIES = re.compile(r'^qwen3_serve:replica_(\w+?)(?:_total)?\{[^}]*replica="((?:[^"\\]|\\.)*)"'
                     r'[^}]*\} (\S+)$', re.M)
_LORA = re.compile(r'^qwen3_serve:replica_lora_loaded\{[^}]*replica="((?:[^"\\]|\\.)*)"'
                   r'[^}]*lora_name="((?:[^"\\]|\\.)*)"[^}]*\} \S+$', re.M)
COLUMNS = ("app", "deployment", "role", "replica", "state", "node", "pid", "running",
           "waiting", "kv_usage", "prefix_hit", "kv_moved", "fallbacks", "loras")
# A prefill/decode app's deployments (cluster/api/pd_app.py): the role is the name's suffix.
_ROLES = ("prefill", "decode")


def per_replica_metrics(metrics_text: str) -> dict[str, dict[str, float]]:
    """replica id -> {series key: value} from a /metrics text."""
    out: dict[str, dict[str, float]] = {}
    for key, rid, value in _SERIES.findall(metrics_text):
        out.setdefault(_unescape(rid), {})[key] = float(value)
    return out


def loaded_adapters(metrics_text: str) -> dict[str, list[str]]:
    """replica id -> the LoRA adapters it has loaded, from a /metrics text."""
    out: dict[str, list[str]] = {}
    for rid, name in _LORA.findall(metrics_text):
        out.setdefault(_unescape(rid), []).append(_unescape(name))
    return out


def _unescape(label: str) -> str:
    return label.replace('\\"', '"').replace("\\\\", "\\")


def replica_rows(details: dict[str, Any], metrics_text: str) -> list[dict[str, str]]:
    """One row per replica of every application in Serve's `details`, with the engine's numbers
    where /metrics has them."""
    metrics = per_replica_metrics(metrics_text)
    loras = loaded_adapters(metrics_text)
    rows = []
    for app_name, app in sorted((details.get("applications") or {}).items()):
        for dep_name, dep in sorted((app.get("deployments") or {}).items()):
            for rep in sorted(dep.get("replicas") or [], key=lambda r: r["replica_id"]):
                m = metrics.get(rep["replica_id"], {})
                queries = m.get("prefix_cache_queries", 0.0)
                moved = m.get("kv_transfer_bytes_out", 0.0) + m.get("kv_transfer_bytes_in", 0.0)
                role = dep_name.rsplit("-", 1)[-1]
                rows.append({
                    "app": app_name, "deployment": dep_name,
                    "role": role if role in _ROLES else "-", "replica": rep["replica_id"],
                    "state": str(rep.get("state", "?")), "node": rep.get("node_ip") or "-",
                    "pid": str(rep.get("pid") or "-"),
                    "running": _int(m.get("num_requests_running")),
                    "waiting": _int(m.get("num_requests_waiting")),
                    "kv_usage": _pct(m.get("kv_cache_usage_perc")),
                    "prefix_hit": _pct(m.get("prefix_cache_hits", 0.0) / queries
                                       if queries else None),
                    "kv_moved": _bytes(moved) if m else "-",
                    "fallbacks": _int(m.get("kv_transfer_fallbacks")),
                    "loras": ",".join(loras.get(rep["replica_id"], [])) or "-",
                })
    return rows


def format_table(rows: list[dict[str, str]]) -> str:
    widths = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in COLUMNS}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in COLUMNS).rstrip()]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in COLUMNS).rstrip() for r in rows]
    return "\n".join(lines)


def metrics_url(details: dict[str, Any]) -> str:
    """Where the app's /metrics is, from Serve's HTTP options (a wildcard host is reached on
    the loopback)."""
    http = details.get("http_options") or {}
    host = http.get("host") or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{host}:{http.get('port', 8000)}/metrics"


def _int(x: float | None) -> str:
    return "-" if x is None else str(int(x))


def _bytes(x: float) -> str:
    return f"{x / 2**20:.1f}MiB" if x >= 2**20 else f"{x / 2**10:.0f}KiB"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev status", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=os.environ.get("RAY_DASHBOARD_ADDRESS",
                                                            "http://127.0.0.1:8265"),
                        help="the Ray dashboard (default: $RAY_DASHBOARD_ADDRESS or :8265)")
    parser.add_argument("--metrics-url", help="the app's /metrics (default: from Serve's "
                        "HTTP options)")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # as `serve status` needs it
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    try:
        details = ServeSubmissionClient(args.address).get_serve_details()
    except Exception as e:  # noqa: BLE001 - a CLI: say what failed, no traceback
        print(f"cannot read Serve's status from the dashboard at {args.address}: {e}",
              file=sys.stderr)
        return 1
    if not details.get("applications"):
        print("no Serve application is running")
        return 0
    url = args.metrics_url or metrics_url(details)
    try:
        text = httpx.get(url, timeout=10).raise_for_status().text
    except httpx.HTTPError as e:
        print(f"engine numbers left out: GET {url} failed: {e}", file=sys.stderr)
        text = ""
    print(format_table(replica_rows(details, text)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
