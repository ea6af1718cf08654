"""What the batch tests share to kill an engine actor mid-job: find this session's engine
actors and consume a dataset while SIGKILLing one once the first rows are out."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import psutil


def engine_actor_pids() -> set[int]:
    """The engine actors of this session's Ray cluster (its processes descend from this one;
    other sessions on the machine run their own), by the process title Ray gives them."""
    pids = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if "MapBatches(EngineStage)" in " ".join(proc.cmdline()):
                pids.add(proc.pid)
        except psutil.Error:
            continue
    return pids


def consume_killing_one_engine(ds: Any) -> tuple[list[dict[str, Any]], int]:
    """Every row of `ds` (one engine actor), that actor SIGKILLed once the first rows are
    out; and how many rows were out before the kill."""
    out: list[dict[str, Any]] = []
    failure: list[BaseException] = []

    def consume() -> None:
        try:
            out.extend(ds.iter_rows())
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            failure.append(e)

    before = engine_actor_pids()  # an earlier job's, on their way out
    thread = threading.Thread(target=consume)
    thread.start()
    deadline = time.monotonic() + 180
    while not out and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = engine_actor_pids() - before
    assert thread.is_alive() and out and len(pids) == 1, "no engine actor mid-job to kill"
    done_before_kill = len(out)
    os.kill(pids.pop(), signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive() and not failure, failure
    return out, done_before_kill
