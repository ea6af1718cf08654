"""The compiled graph's blocking calls (a plan's submit, a step's read), made so that a long
step is waited for and a dead rank is not.

Ray 2.60 bounds each call by the graph's timeouts (`RAY_CGRAPH_get_timeout`,
`RAY_CGRAPH_submit_timeout`: 10 s by default): a step that runs longer raises
RayChannelTimeoutError, which the executor cannot tell from a dead rank. A long timeout alone
is no answer either: when a rank's node is lost, nothing wakes the blocked read for a long time
(the graph's monitor waits on every rank's loop, and the live ranks sit in a collective), and
the short timeout was what noticed it.

So each call runs on the executor's `DagCaller` thread with Ray's timeout past STEP_BOUND_S,
and the caller waits for it in slices of SLICE_S, asking the GCS between slices whether every
rank's actor and node are alive (`dead_rank`: no actor call, which a rank busy in the graph's
loop could not answer). A dead rank, or a call still waiting after STEP_BOUND_S, raises at once;
the executor then kills the ranks and tears the graph down, which closes its channels and so
wakes the call.

Why not poll the graph's own `_execute_until(index, channel, timeout)` in short slices: a read
of several output channels (one per rank) that times out after some of them were read loses
their values (ray/experimental/channel/common.py, `SynchronousReader._read_list`), and the next
read of those channels waits for the following step. With pipeline stages, whose first ranks
reply long before the last, a slice would end between them in every long step. A submit's
write to several readers can be cut halfway the same way. So a call is made once, with a
timeout it never reaches while every rank lives.

Invariant: a `DagCaller` makes one call at a time, in the order asked (the graph is not
thread-safe, and its caller waits for each call before the next); one whose graph failed is
closed and never used again (a rebuilt executor has a new graph and a new caller).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# How often a caller waiting on a call asks the GCS whether the ranks are alive.
SLICE_S = 1.0
# The longest a step may take with every rank alive before the executor gives up on it.
STEP_BOUND_S = 30 * 60.0
# Ray's own timeout on a call lies this far past STEP_BOUND_S: it fires only if the teardown
# after a failure did not wake the call (then the abandoned caller's thread still ends).
_RAY_MARGIN_S = 60.0


class RankLostError(RuntimeError):
    """The GCS says a rank's actor or its node is dead while a call waits on the graph."""


class StepBoundError(TimeoutError):
    """A call waited STEP_BOUND_S with every rank alive."""


def ray_timeout_s() -> float:
    """The timeout to give Ray's call (the graph's submit timeout, a read's `ray.get`)."""
    return STEP_BOUND_S + _RAY_MARGIN_S


def wait_alive(future: concurrent.futures.Future, dead: Callable[[], str | None]) -> Any:
    """`future`'s result, waited for in SLICE_S slices; between slices `dead()` (why a rank is
    dead, or None). RankLostError as soon as a rank is dead; StepBoundError after
    STEP_BOUND_S. A call that failed raises its own error."""
    deadline = time.monotonic() + STEP_BOUND_S
    while True:
        done, _ = concurrent.futures.wait([future], timeout=SLICE_S)
        if done:
            return future.result()
        why = dead()
        if why is not None:
            raise RankLostError(why)
        if time.monotonic() >= deadline:
            raise step_bound_error()


def step_bound_error() -> StepBoundError:
    """What a call that waited STEP_BOUND_S with every rank alive raises (a host channel's
    read too: host_channel.py)."""
    return StepBoundError(f"a step did not finish within STEP_BOUND_S = {STEP_BOUND_S:g} s "
                          "(cluster/engine/dag_calls.py) although every rank is alive")


class DagCaller:
    """One daemon thread that makes the compiled graph's blocking calls, one at a time, while
    `call`'s caller waits in slices (daemon: a call no teardown woke cannot hold up the
    process's exit)."""

    def __init__(self, dead: Callable[[], str | None]) -> None:
        self._dead = dead
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="dag-calls", daemon=True).start()

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            future, fn, args = item
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 — handed to whoever waits on it
                future.set_exception(e)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the caller's thread, waited for by `wait_alive`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args))
        return wait_alive(future, self._dead)

    def close(self) -> None:
        """End the thread once its current call (if any) returns."""
        self._calls.put(None)


def dead_rank(actors: list[Any]) -> str | None:
    """Why one of `actors` (rank order) is dead by the GCS's tables, or None: its actor is
    DEAD, or the node it was placed on is not alive. A GCS that cannot be asked says nothing
    (logged; STEP_BOUND_S still bounds the wait)."""
    import ray
    from ray._private import state

    try:
        placed: dict[int, str] = {}
        for rank, actor in enumerate(actors):
            info = state.actors(actor_id=actor._actor_id.hex())
            if info.get("State") == "DEAD":
                return f"rank {rank}'s actor is DEAD (the GCS's actor table)"
            if info.get("Address", {}).get("NodeID"):
                placed[rank] = info["Address"]["NodeID"]
        alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
    except Exception as e:  # noqa: BLE001 — a probe: the step's own outcome still counts
        logger.warning("could not ask the GCS whether the ranks are alive: %s: %s",
                       type(e).__name__, e)
        return None
    for rank, node in placed.items():
        if not alive.get(node, False):
            return f"rank {rank}'s node {node} is dead (the GCS's node table)"
    return None
