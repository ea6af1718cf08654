"""The simulated 3-node Ray cluster of this directory's tests and of bench/node_loss.py and
bench/autoscale.py (ray.cluster_utils.Cluster, one host): a head with no CPU to offer (Serve's
controller, the one proxy of `proxy_location: HeadOnly`) and two worker nodes with one CPU
each.

A node loss here is exactly one node's: `kill_node` SIGKILLs that node's raylet and every
process under it (its workers, its agents) at once, as a machine losing power would, and
nothing else. Each simulated node's raylet is a child of the process that added the node, so
its process tree is that node. Two traps of the simulation it avoids:
- Ray starts each raylet with PR_SET_PDEATHSIG (kernel fate-sharing), which fires when the
  *thread* that started it exits: a node added from a worker thread (`asyncio.to_thread`, a
  thread pool) dies with that thread. Add nodes from the main thread only (`add_node`).
- `Cluster.remove_node` kills only the raylet and leaves its workers to notice and exit on
  their own; until they do, a killed node's replica may still answer.
The GCS declares a node dead after `health_check_failure_threshold` failed checks: a killed
raylet's port refuses at once, so that is threshold x period (5 x 1 s here, not Ray's 5 x 3 s);
a live raylet that is slow to answer (the host overloaded) fails a check only after
`health_check_timeout_ms`, so marking it dead by mistake takes 5 x 10 s of silence, as in Ray's
defaults.
A node that does not register within Ray's fixed 30 s (`Node.__init__`: "timed out during
startup", seen on CI with another xdist worker loading the host) is killed with everything it
started and started again (`_started`), at most `START_ATTEMPTS` times; the nodes start one at
a time, so the GCS registers one at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from session_ports import free_port  # (tests/cluster: its conftest puts it on sys.path)

# The GCS's health checks of every raylet (Ray's defaults: 3000, 10000, 5).
GCS_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 10000,
                     "health_check_failure_threshold": 5}


# Serve's fixed ports beside the HTTP front (HAProxy's stats page and exporter, the fallback
# proxy), fresh for each simulated cluster, below the ephemeral range (session_ports.py):
# tests/cluster/conftest.py picks them once per test session, and an HAProxy of an earlier
# cluster whose actor was killed before it stopped its process (`ray.shutdown` right after
# `serve.shutdown`) may still hold them.
SERVE_SIDE_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT")


# Tries for each simulated node (the head included) to register with the GCS in Ray's 30 s.
START_ATTEMPTS = 3


def _children(pid: int) -> set[int]:
    """The direct children of process `pid` (from /proc; Linux)."""
    return set(_child_lists().get(pid, []))


def _started(start: Any) -> Any:
    """`start()`, a call that starts one Ray node as this process's child; a node that timed
    out registering is SIGKILLed with its whole process tree (its raylet would register later
    and add CPUs the test does not expect) and started again, `START_ATTEMPTS` tries in all."""
    for attempt in range(1, START_ATTEMPTS + 1):
        before = _children(os.getpid())
        try:
            return start()
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == START_ATTEMPTS:
                raise
            for child in _children(os.getpid()) - before:
                for pid in _process_tree(child):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(child, 0)
    raise AssertionError("unreachable")


class Sim:
    """The simulated cluster and the app's URL."""

    def __init__(self, cluster: Any, url: str) -> None:
        self.cluster = cluster
        self.url = url


def add_node(cluster: Any, wait: bool = True, num_cpus: int = 1) -> Any:
    """A worker node (1 CPU unless told); from the main thread only (see the module
    docstring). With `wait`, it returns once the GCS's resource view holds the node's CPUs
    (registered is not enough: a loaded host reports a new node's resources seconds later,
    and a placement group needing them stays pending meanwhile)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("add a simulated node from the main thread: its raylet dies with "
                           "the thread that started it (PR_SET_PDEATHSIG)")
    node = _started(lambda: cluster.add_node(wait=wait, num_cpus=num_cpus))
    if wait and num_cpus:
        import ray
        from ray._private.state import total_resources_per_node

        if ray.is_initialized():
            deadline = time.monotonic() + 60
            while total_resources_per_node().get(node.node_id, {}).get("CPU", 0) < num_cpus:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the new node {node.node_id}'s {num_cpus} CPU(s) are "
                                       "not in the GCS's resource view after 60 s")
                time.sleep(0.2)
    return node


def _child_lists() -> dict[int, list[int]]:
    """Every process's direct children, by parent PID (from /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # (the name may hold spaces)
        children.setdefault(ppid, []).append(int(entry))
    return children


def _process_tree(root: int) -> list[int]:
    """`root` and every process descended from it (from /proc; Linux)."""
    children = _child_lists()
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def kill_node(cluster: Any, node: Any) -> list[int]:
    """SIGKILL `node`'s raylet and every process under it at once; returns their PIDs.
    The other nodes' processes are not touched (asserted)."""
    from ray import ray_constants

    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
    others = [n.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
              for n in cluster.worker_nodes if n is not node]
    pids = _process_tree(raylet.pid)
    for other in others:
        assert other.pid not in pids, "a simulated node's processes under another's raylet"
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # Reaps the raylet (our child) and drops the node from the cluster's books.
    cluster.remove_node(node, allow_graceful=False)
    assert all(o.poll() is None for o in others), "another node's raylet died with this one"
    return pids


@contextlib.contextmanager
def simulated_cluster(node_cpus: tuple[int, ...] = (1, 1)) -> Iterator[Sim]:
    """The head with no CPU (Serve's controller, the HeadOnly proxy) and worker nodes of
    `node_cpus` CPUs (two 1-CPU nodes by default), Serve started on a free port; all stopped
    on exit (bench/node_loss.py and bench/autoscale.py run on it too). A Ray this process is
    connected to already (the test session's one-node cluster, tests/cluster/conftest.py) is
    left first: a process talks to one cluster."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # its HAProxy is under this process (ray.init started its raylet)
        _stop_cluster(_haproxies(os.getpid()), serve.shutdown, ray.shutdown)
    saved = {key: os.environ.get(key) for key in SERVE_SIDE_PORTS}
    os.environ.update({key: str(free_port()) for key in SERVE_SIDE_PORTS})
    # (its own dashboard port: the head binds one even without the UI, and Ray's 8265 may be
    # another cluster's on this machine: another xdist worker's, another session's)
    cluster = _started(lambda: Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "dashboard_port": free_port(),
        "_system_config": GCS_HEALTH_CHECKS}))
    try:
        for cpus in node_cpus:  # one at a time: each registers with the GCS before the next
            add_node(cluster, wait=False, num_cpus=cpus)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        yield Sim(cluster, f"http://127.0.0.1:{port}")
    finally:
        try:
            _stop_cluster(_haproxies(_raylet_pid(cluster.head_node)), serve.shutdown,
                          ray.shutdown, cluster.shutdown)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _raylet_pid(node: Any) -> int:
    from ray import ray_constants

    return node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid


def _haproxies(root: int) -> list[int]:
    """The HAProxy processes (Serve's HTTP front) under process `root`."""
    found = []
    for pid in _process_tree(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(b"haproxy" in os.path.basename(a) for a in argv[:2]):
            found.append(pid)
    return found


def _stop_cluster(haproxies: list[int], *stops: Any) -> None:
    """Run each of `stops` in order, even after one failed (the first failure is raised), then
    SIGKILL the `haproxies` that outlived them: `ray.shutdown` may kill Serve's HAProxy actor
    before it stopped its process, which then holds its ports for the rest of the session."""
    failure: BaseException | None = None
    for stop in stops:
        try:
            stop()
        except BaseException as exc:  # noqa: BLE001 - raised below, after the rest ran
            failure = failure or exc
    for pid in haproxies:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if failure is not None:
        raise failure


def alive_actors(class_name: str) -> list[dict[str, Any]]:
    """The cluster's live actors of one class (their "Address" names their node)."""
    import ray

    return [a for a in ray._private.state.actors().values()
            if a["ActorClassName"] == class_name and a["State"] == "ALIVE"]
