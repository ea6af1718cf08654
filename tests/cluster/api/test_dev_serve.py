"""`./dev serve` as a user runs it (scripts/serve.sh, what `./dev serve` runs once .venv is set
up), in its own Ray cluster: nothing it starts listens beyond 127.0.0.1, Ray's token
authentication is on, Ctrl-C stops everything within 10 s, and no warning repeats in its log.

The app is the tiny manifest on free ports (HTTP, HAProxy's stats page and exporter, Serve's
fallback proxy), so it runs beside the test session's own cluster.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.api import serve_env
from workers.distributed import get_free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
READY_TIMEOUT_S = 240
CTRL_C_LIMIT_S = 10


@dataclass
class DevServe:
    proc: subprocess.Popen
    base_url: str
    log: Path


def _listening_sockets() -> dict[int, tuple[str, int]]:
    """Every listening TCP socket on the machine: inode -> (address, port)."""
    out = {}
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] != "0A":  # TCP_LISTEN
                    continue
                hex_ip, hex_port = fields[1].split(":")
                raw = b"".join(struct.pack("<I", int(hex_ip[i:i + 8], 16))
                               for i in range(0, len(hex_ip), 8))
                family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
                out[int(fields[9])] = (socket.inet_ntop(family, raw), int(hex_port, 16))
    return out


def _process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _listeners(pids: list[int]) -> list[tuple[str, str, int]]:
    """(process title, address, port) of every listening socket the processes hold."""
    sockets = _listening_sockets()
    found = set()
    for pid in pids:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = int(link[8:-1]) if link.startswith("socket:[") else None
            if inode in sockets:
                found.add((title, *sockets[inode]))
    return sorted(found)


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1") or \
        address.startswith("::ffff:127.")


def _started_at(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), None if it is gone or a zombie:
    with the pid it names one process, even after the pid is reused."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _snapshot(root: int) -> dict[int, int | None]:
    return {pid: _started_at(pid) for pid in _process_tree(root)}


def _still_running(snapshot: dict[int, int | None]) -> list[int]:
    return [pid for pid, start in snapshot.items()
            if start is not None and _started_at(pid) == start]


@pytest.fixture(scope="module")
def dev_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServe]:
    tmp = tmp_path_factory.mktemp("dev_serve")
    port = get_free_port()
    manifest = yaml.safe_load((ROOT / "manifests" / "qwen3-tiny.yaml").read_text())
    manifest["http_options"]["port"] = port
    (tmp / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    # As a user's shell has it: none of serve_env's settings (the script sets them), no
    # RAY_AUTH_MODE (the test session turns auth off for its own cluster), no cluster to join.
    env = {k: v for k, v in os.environ.items()
           if k not in serve_env.proxy_env() and k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    env.update(PYTHONPATH=str(ROOT), RAY_SERVE_HAPROXY_STATS_PORT=str(get_free_port()),
               RAY_SERVE_HAPROXY_METRICS_PORT=str(get_free_port()),
               RAY_SERVE_FALLBACK_PROXY_HTTP_PORT=str(get_free_port()))
    log = tmp / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(ROOT / "scripts" / "serve.sh"), str(tmp / "manifest.yaml")],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    started = _snapshot(proc.pid)
    try:
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"serve.sh exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{base_url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        yield DevServe(proc, base_url, log)
    finally:
        if proc.poll() is None:  # a test failed before Ctrl-C: stop what this module started
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        started.update(_snapshot(proc.pid))
        for pid in _still_running(started):
            os.kill(pid, signal.SIGKILL)


def test_serves_with_every_listener_on_loopback(dev_serve: DevServe) -> None:
    chat = httpx.post(f"{dev_serve.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 8
    listeners = _listeners(_process_tree(dev_serve.proc.pid))
    titles = [title for title, _, _ in listeners]
    # The walk found the app: the ingress replica's own HTTP server, and HAProxy in front.
    assert any(t.startswith("ray::ServeReplica:qwen3:OpenAIIngress") for t in titles), listeners
    assert not serve_env.haproxy_available() or any(t.endswith("/haproxy") for t in titles)
    exposed = [entry for entry in listeners if not _is_loopback(entry[1])]
    # (rank 0's torch.distributed store too: workers/distributed.py binds it to the host the
    # engine's tcp://127.0.0.1:PORT names, where torch's own tcp:// init binds every interface)
    assert not exposed, listeners


def test_ray_token_authentication_is_on(dev_serve: DevServe) -> None:
    match = re.search(r"View the dashboard at \S*(http://127\.0\.0\.1:\d+)",
                      dev_serve.log.read_text())
    assert match, "the Ray dashboard's address is not in the log"
    url = f"{match[1]}/api/serve/applications/"
    assert httpx.get(url, timeout=30).status_code == 401
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    apps = httpx.get(url, timeout=30, headers={"Authorization": f"Bearer {token}"})
    assert apps.status_code == 200 and "qwen3" in apps.json()["applications"]


def test_ctrl_c_stops_everything_within_10s(dev_serve: DevServe) -> None:
    started = _snapshot(dev_serve.proc.pid)
    sent = time.monotonic()
    os.killpg(dev_serve.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    dev_serve.proc.wait(timeout=CTRL_C_LIMIT_S + 20)
    took = time.monotonic() - sent
    assert took < CTRL_C_LIMIT_S, f"serve run took {took:.1f}s to stop"
    deadline = time.monotonic() + 5
    while _still_running(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [Path(f"/proc/{pid}/cmdline").read_bytes()[:80]
            for pid in _still_running(started)] == []


def test_no_warning_repeats_in_the_log(dev_serve: DevServe) -> None:
    # Python warnings as `file:line: XWarning: text`, each under its process's "(name pid=N)".
    warnings = Counter(re.sub(r"^\S*\(.*? pid=\d+\)\S*\s*", "", line)
                       for line in dev_serve.log.read_text().splitlines()
                       if re.search(r"\w+Warning: ", line))
    # Once per process at most: the tp-2 workers are the most processes running one piece
    # of code; a warning raised per request or per step would show up many times.
    assert all(n <= 2 for n in warnings.values()), warnings
