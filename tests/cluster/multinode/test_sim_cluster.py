"""sim_cluster's restart of a simulated node that timed out registering (no Ray started: the
start call here spawns a real child process and fails as Ray's `Node.__init__` does)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from sim_cluster import START_ATTEMPTS, _children, _started


def test_a_node_that_timed_out_is_killed_with_its_children_and_started_again() -> None:
    spawned: list[subprocess.Popen] = []
    first_children: set[int] = set()

    def start() -> str:
        # a "raylet" with a child of its own, as a node's processes are
        child = subprocess.Popen([sys.executable, "-c",
                                  "import subprocess, sys, time; subprocess.Popen([sys.executable,"
                                  " '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
        spawned.append(child)
        if len(spawned) == 1:
            while not first_children:  # its own child is up before the failure
                first_children.update(_children(child.pid))
            raise Exception("The current node timed out during startup. This could happen ...")
        return "node"

    grandchildren_before = set()
    try:
        assert _started(start) == "node"
        assert len(spawned) == 2
        first, second = spawned
        assert not os.path.exists(f"/proc/{first.pid}"), "the timed-out node is still running"
        deadline = time.monotonic() + 10  # SIGKILLed; gone once the kernel has delivered it
        while any(_alive(pid) for pid in first_children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in first_children), \
            "a process of the timed-out node is still running"
        assert second.poll() is None, "the node started again was killed"
        grandchildren_before = _children(second.pid)
    finally:
        for process in spawned:
            process.kill()
        for pid in grandchildren_before:
            os.kill(pid, 9)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_other_failures_and_the_last_timeout_are_raised() -> None:
    calls = []

    def other() -> None:
        calls.append(1)
        raise ValueError("bad node args")

    with pytest.raises(ValueError, match="bad node args"):
        _started(other)
    assert len(calls) == 1  # not retried

    def always_late() -> None:
        calls.append(1)
        raise Exception("The current node timed out during startup.")

    calls.clear()
    with pytest.raises(Exception, match="timed out during startup"):
        _started(always_late)
    assert len(calls) == START_ATTEMPTS
