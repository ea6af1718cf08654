"""`RankGroup`: one generation of a RayExecutor's ranks and everything bound to it.

Invariant: a group is stopped once (RayExecutor._stop under `lock`; a second stop waits for
the first to end) and never reused: a rebuild makes a new one. Work still queued on an old
group's thread, or a call of it that returns late, touches only that group: it finds the group
dead or stopped and raises WorkerDiedError. (Before groups, such a call read the executor's
fields after a rebuild had replaced them and stopped the *new* ranks halfway through their
start, leaving the others in a rendezvous that never completed.)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections import deque
from typing import Any

from cluster.engine.dag_calls import DagCaller
from cluster.engine.host_channel import HostChannel
from cluster.engine.wakeup import CallCounter, WakeSockets


@dataclasses.dataclass(eq=False)
class RankGroup:
    """The ranks' actors, the compiled graph, its caller, the thread that makes every graph
    call, the wake sockets and the calls in flight."""

    workers: list
    thread: concurrent.futures.ThreadPoolExecutor
    caller: DagCaller | None = None
    dag: Any = None
    channel: HostChannel | None = None  # ranks on the engine's host: instead of `dag`
    sockets: WakeSockets | None = None
    finished: CallCounter | None = None  # the output rank's finished calls (wakeup.py)
    reads: int = 0  # outputs read from the graph so far
    dead: str | None = None  # why a rank of this group failed
    stopped: bool = False
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    # (DAG output ref futures, oldest first, each with the step whose result it carries: None
    # for a call that followed none.)
    outputs: deque = dataclasses.field(default_factory=deque)
    last_launched: int | None = None
    calls: dict = dataclasses.field(default_factory=dict)  # not lagged: step -> call
    bitmask_refs: list = dataclasses.field(default_factory=list)
    # Parking (cluster/engine/wakeup.py): the Park call's output while parked; not lagged,
    # park outputs the next read must skip.
    parked: concurrent.futures.Future | None = None
    unread_parks: deque = dataclasses.field(default_factory=deque)
    # One graph call at a time (`serial`): the call not yet read, and the outputs read ahead
    # of their `_dag_get` before the next call was written (id of the call's ref -> the ref
    # and its outputs).
    serial: bool = False
    unread: Any = None
    read_ahead: dict = dataclasses.field(default_factory=dict)
