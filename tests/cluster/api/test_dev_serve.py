"""`./dev serve` as a user runs it (scripts/serve.sh, what `./dev serve` runs once .venv is set
up), in its own Ray cluster: nothing it starts listens beyond 127.0.0.1, Ray's token
authentication is on, the README's `bash` blocks run as written against it, SIGINT and SIGTERM
stop everything within 10 s also when it was started in the background (the shell starts a
background job with SIGINT ignored), no warning repeats in its log, and a manifest with an
unknown key exits at once naming it, before Ray starts.

The apps are the tiny manifest on free ports (HTTP, HAProxy's stats page and exporter, Serve's
fallback proxy), so they run beside the test session's own cluster.
"""

from __future__ import annotations

import contextlib
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
from session_ports import free_port

from cluster.api import serve_env

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


def _user_env(**extra: str) -> dict[str, str]:
    """As a user's shell has it: none of serve_env's settings (the script sets them), no
    RAY_AUTH_MODE (the test session turns auth off for its own cluster), no cluster to join;
    Serve's other fixed ports on free ones."""
    env = {k: v for k, v in os.environ.items()
           if k not in serve_env.proxy_env() and k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    env.update(PYTHONPATH=str(ROOT), RAY_SERVE_HAPROXY_STATS_PORT=str(free_port()),
               RAY_SERVE_HAPROXY_METRICS_PORT=str(free_port()),
               RAY_SERVE_FALLBACK_PROXY_HTTP_PORT=str(free_port()), **extra)
    return env


def _ignore_sigint() -> None:
    """What a shell does to a job it starts in the background (`./dev serve &`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _serve_in_background(tmp: Path, args: list[str], env: dict[str, str],
                         port: int) -> Iterator[DevServe]:
    """scripts/serve.sh started as a background job; stops what it started, whatever happens."""
    log = tmp / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(ROOT / "scripts" / "serve.sh"), *args], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_ignore_sigint)
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
        if proc.poll() is None:  # a test failed before stopping it: stop what it started
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        started.update(_snapshot(proc.pid))
        for pid in _still_running(started):
            os.kill(pid, signal.SIGKILL)


def _holders(port: int) -> list[tuple[int, str]]:
    """(pid, process title) of every process on the machine listening on 127.0.0.1/any:`port`
    (also one that left the process tree, as a daemonizing child does)."""
    inodes = {inode for inode, (_, p) in _listening_sockets().items() if p == port}
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
            links = [os.readlink(f"/proc/{entry}/fd/{fd}") for fd in fds]
            title = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if any(link.startswith("socket:[") and int(link[8:-1]) in inodes for link in links):
            found.append((int(entry), title))
    return found


def _port_free(port: int) -> bool:
    """A new server can listen on `port` again. It binds as servers do (uvicorn, HAProxy), with
    SO_REUSEADDR: without it, Linux refuses the port while a connection the stopped server
    closed first sits in TIME_WAIT (up to 60 s), which says nothing about what still runs;
    a socket still listening there is refused either way."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


def _stop_and_check(dev: DevServe, signum: int) -> None:
    """`signum` to serve.sh's process only (as `kill` does): it and everything it started
    are gone, and its port is free, within CTRL_C_LIMIT_S."""
    started = _snapshot(dev.proc.pid)
    sent = time.monotonic()
    os.kill(dev.proc.pid, signum)
    dev.proc.wait(timeout=CTRL_C_LIMIT_S + 20)
    port = int(dev.base_url.rsplit(":", 1)[1])
    deadline = sent + CTRL_C_LIMIT_S
    while ((_still_running(started) or not _port_free(port))
           and time.monotonic() < deadline):
        time.sleep(0.2)
    took = time.monotonic() - sent
    assert [Path(f"/proc/{pid}/cmdline").read_bytes()[:80]
            for pid in _still_running(started)] == []
    assert _holders(port) == []  # no process of any kind listens there any more
    assert _port_free(port)
    assert took < CTRL_C_LIMIT_S, f"stopping took {took:.1f}s"
    assert "Got KeyboardInterrupt, shutting down" in dev.log.read_text()  # Serve shut down


@pytest.fixture(scope="module")
def dev_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServe]:
    tmp = tmp_path_factory.mktemp("dev_serve")
    port = free_port()
    manifest = yaml.safe_load((ROOT / "manifests" / "qwen3-tiny.yaml").read_text())
    manifest["http_options"]["port"] = port
    (tmp / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    with _serve_in_background(tmp, [str(tmp / "manifest.yaml")], _user_env(), port) as dev:
        yield dev


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
    url = f"{_dashboard(dev_serve.log)}/api/serve/applications/"
    assert httpx.get(url, timeout=30).status_code == 401
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    apps = httpx.get(url, timeout=30, headers={"Authorization": f"Bearer {token}"})
    assert apps.status_code == 200 and "qwen3" in apps.json()["applications"]


def test_no_warning_repeats_in_the_log(dev_serve: DevServe) -> None:
    # Python warnings as `file:line: XWarning: text`, each under its process's "(name pid=N)".
    warnings = Counter(re.sub(r"^\S*\(.*? pid=\d+\)\S*\s*", "", line)
                       for line in dev_serve.log.read_text().splitlines()
                       if re.search(r"\w+Warning: ", line))
    # Once per process at most: the tp-2 workers are the most processes running one piece
    # of code; a warning raised per request or per step would show up many times.
    assert all(n <= 2 for n in warnings.values()), warnings


def readme_blocks(lang: str) -> list[str]:
    """The README's fenced code blocks in `lang`, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", (ROOT / "README.md").read_text(),
                      flags=re.M | re.S)


def _dashboard(log: Path) -> str:
    match = re.search(r"View the dashboard at \S*(http://127\.0\.0\.1:\d+)", log.read_text())
    assert match, "the Ray dashboard's address is not in the log"
    return match[1]


def test_readme_bash_blocks_run_as_written(dev_serve: DevServe) -> None:
    """Each `bash` block of the README in a fresh shell: no .venv on PATH, no RAY_AUTH_MODE;
    the port is this server's, and the dashboard address is given because another cluster on
    this machine may hold Ray's default one (the README says so)."""
    blocks = readme_blocks("bash")
    assert len(blocks) >= 2 and any("serve status" in b for b in blocks)
    env = {"HOME": os.environ["HOME"], "PATH": "/usr/local/bin:/usr/bin:/bin",
           "LANG": "C.UTF-8", "HF_HUB_OFFLINE": "1",
           "RAY_DASHBOARD_ADDRESS": _dashboard(dev_serve.log)}
    outputs = []
    for block in blocks:
        script = block.replace("127.0.0.1:8000", dev_serve.base_url.removeprefix("http://"))
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{block}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        outputs.append(done.stdout)
    text = "\n".join(outputs)
    assert "data: [DONE]" in text and '"root":"' in text
    assert re.search(r"qwen3:\s+status: RUNNING", text), text
    # ./dev status: the one LLMServer replica with its engine's numbers, and the ingress
    assert re.search(r"^qwen3\s+LLMServer\s+-\s+\S+\s+RUNNING\s+127\.0\.0\.1\s+\d+\s+\d+\s+\d+"
                     r"\s+\d+\.\d%", text, re.M), text
    assert re.search(r"^qwen3\s+OpenAIIngress\s+-\s+\S+\s+RUNNING", text, re.M), text


def test_sigint_stops_a_background_server_within_10s(dev_serve: DevServe) -> None:
    _stop_and_check(dev_serve, signal.SIGINT)


def test_sigterm_stops_a_background_server_within_10s(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The default manifest, its port moved by QWEN3_SERVE_PORT."""
    tmp = tmp_path_factory.mktemp("dev_serve_sigterm")
    port = free_port()
    with _serve_in_background(tmp, [], _user_env(QWEN3_SERVE_PORT=str(port)), port) as dev:
        models = httpx.get(f"{dev.base_url}/v1/models", timeout=30).json()
        assert models["data"][0]["id"] == "qwen3-tiny"
        _stop_and_check(dev, signal.SIGTERM)


def test_unknown_manifest_key_exits_before_ray_starts(tmp_path: Path) -> None:
    manifest = yaml.safe_load((ROOT / "manifests" / "qwen3-tiny.yaml").read_text())
    manifest["applications"][0]["args"]["max_num_seq"] = 8  # a typo of max_num_seqs
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(manifest))
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()
    began = time.monotonic()
    done = subprocess.run([str(ROOT / "scripts" / "serve.sh"), str(tmp_path / "bad.yaml")],
                          cwd=ROOT, env=_user_env(RAY_TMPDIR=str(ray_tmp)), capture_output=True,
                          text=True, timeout=120)
    took = time.monotonic() - began
    assert done.returncode == 2, done.stdout + done.stderr
    assert "'max_num_seq'" in done.stderr and "valid ones" in done.stderr
    assert "application 'qwen3'" in done.stderr
    assert list(ray_tmp.iterdir()) == []  # no Ray session was started
    # about a second on an idle machine (importing Ray Serve); generous for a loaded one
    assert took < 20, f"took {took:.1f}s"
