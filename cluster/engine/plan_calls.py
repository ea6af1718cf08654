"""`PlanCalls`: how a `RayExecutor` call reaches every rank of its group and how the ranks'
outputs come back, on either transport a group has: the host channel (host_channel.py, ranks
on the engine's host: written on the caller's thread, read on the group's thread) or the Ray
Compiled Graph (ranks elsewhere: every call on the group's thread through its `DagCaller`,
idle ranks parked on wake sockets, wakeup.py). The executor (ray_executor.py) owns the group's
life: start, rebuild, failure, stop; this owns the calls in between.

Invariants (the executor's, kept here): a group's calls are written in submit order and their
outputs read in that order, each once (`RankGroup.reads` counts them); a park is always
followed by a wake before anything the graph returns after it is read; any failure of a call
fails the whole group (`_fail`, the executor's), and a call of a stopped group raises
WorkerDiedError.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from cluster.engine import dag_calls, host_channel
from cluster.engine.dag_calls import ray_timeout_s
from cluster.engine.executor import WorkerDiedError, plans_in_flight
from cluster.engine.host_channel import HostChannel
from cluster.engine.rank_group import RankGroup
from cluster.engine.wakeup import CallCounter, Park, WakeSockets
from scheduler.plan import StepPlan, StepResult

if TYPE_CHECKING:
    from workers.config import WorkerConfig

logger = logging.getLogger(__name__)


class PlanCalls:
    """The call half of `RayExecutor` (a base class of it): the attributes below, and
    `_wait_all` and `_fail`, are the executor's."""

    _g: RankGroup | None
    _config: WorkerConfig
    _lagged: bool
    _output_rank: int
    rebuilds_without_step: int

    @staticmethod
    def _check(g: RankGroup) -> None:
        """WorkerDiedError unless `g` is alive and running."""
        if g.dead is not None:
            raise WorkerDiedError(g.dead)
        if g.stopped:
            raise WorkerDiedError("the executor's workers were stopped")

    def _open_channel(self, g: RankGroup) -> HostChannel | None:
        """The shared-memory channel to `g`'s ranks, all on this host (host_channel.py): each
        rank maps it and serves it on a thread of its own. None where /dev/shm has no room
        for it (the compiled graph then, as for ranks on other hosts)."""
        # (lagged: async scheduling on one stage; + 2: a lagged result's own call, a spare)
        in_flight = plans_in_flight(self._config.pipeline_parallel_size, self._lagged)
        slots = max(host_channel.MIN_SLOTS, in_flight + 2)
        try:
            channel = HostChannel(len(g.workers), slots)
        except OSError as e:
            logger.warning("no host channel for the ranks (%s): using a compiled graph", e)
            return None
        try:
            pids = self._wait_all(g, [
                w.serve_channel.remote(channel.path, r, len(g.workers), slots,
                                       r == self._output_rank, self._lagged)
                for r, w in enumerate(g.workers)])
        except BaseException:
            channel.close()
            raise
        channel.attached(pids)
        return channel

    def _open_wake_sockets(self, g: RankGroup) -> WakeSockets:
        """Sockets to park `g`'s ranks on and the output rank's counter of finished calls, all
        on this host (ranks on another host spin when idle: no socket reaches them)."""
        sockets = WakeSockets(len(g.workers))
        g.finished = CallCounter.create()
        counted = None if g.finished is None else g.finished.path
        self._wait_all(g, [w.open_wake_socket.remote(p, counted if r == self._output_rank else None)
                           for r, (w, p) in enumerate(zip(g.workers, sockets.paths))])
        if g.finished is not None:
            g.finished.unlink()  # (mapped by both ends now)
        return sockets

    def park(self) -> None:
        g = self._g
        if g.sockets is None or g.parked is not None or g.dead is not None or g.stopped:
            return
        g.parked = self._on_thread(g, self._dag_submit, g, Park())

    def _unpark(self, g: RankGroup) -> None:
        """Wake the parked ranks; the Park call's output is read in order, later."""
        parked, g.parked = g.parked, None
        if parked is None:
            return
        g.sockets.wake()
        if self._lagged:
            g.outputs.append((None, parked))
        else:
            g.unread_parks.append(parked)

    def _compile(self, g: RankGroup) -> Any:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as plan:
            dag = MultiOutputNode([(w.execute_lagged if self._lagged else w.execute).bind(plan)
                                   for w in g.workers])
        # (reads get the same timeout in _dag_get: dag_calls.py bounds a step, not Ray)
        return dag.experimental_compile(_submit_timeout=ray_timeout_s())

    @staticmethod
    def _on_thread(g: RankGroup, fn: Any, *args: Any) -> concurrent.futures.Future:
        """`fn(*args)` queued on `g`'s graph thread (WorkerDiedError if `g` was stopped)."""
        try:
            return g.thread.submit(fn, *args)
        except RuntimeError:  # the thread was shut down: the group stopped
            PlanCalls._check(g)
            raise

    def _submit_call(self, g: RankGroup, plan: StepPlan | None) -> concurrent.futures.Future:
        """A call of `plan` (its message number, or its graph ref, once written). A host
        channel's write never blocks (host_channel.py), so it is made here, on the caller's
        thread, without waiting for the graph thread to wake; a failure is raised from the
        graph thread, where every other failure of the group's calls is."""
        if g.channel is None:
            return self._on_thread(g, self._dag_submit, g, plan)
        written: concurrent.futures.Future = concurrent.futures.Future()
        try:
            written.set_result(g.channel.write(plan, functools.partial(self._given_up, g)))
        except Exception as e:  # noqa: BLE001 — any worker failure ends the group
            return self._on_thread(g, self._fail, g, e)
        return written

    def _read_lagged(self, g: RankGroup, step_id: int) -> StepResult:
        """Read the DAG's outputs in order up to the one carrying `step_id`'s result."""
        while True:
            step, submitted = g.outputs.popleft()
            result = self._dag_get(g, submitted)
            if step == step_id:
                return result

    def _dag_submit(self, g: RankGroup, plan: StepPlan | Park | None) -> Any:
        self._check(g)
        if g.serial and g.unread is not None:  # one call at a time: read the last one first
            last, g.unread = g.unread, None
            g.read_ahead[id(last)] = (last, self._read(g, last))
        try:
            ref = g.caller.call(g.dag.execute, plan)
        except Exception as e:  # noqa: BLE001 — any worker failure ends the group
            self._fail(g, e)
        if g.serial:
            g.unread = ref
        return ref

    def _read(self, g: RankGroup, ref: Any) -> list:
        """Every rank's output of the graph call `ref` (the outputs are read in call order,
        each once: `g.reads` counts them for the counter the read sleeps on)."""
        self._check(g)
        g.reads += 1
        if g.channel is not None:
            deadline = time.monotonic() + dag_calls.STEP_BOUND_S

            def stop() -> bool:
                if self._given_up(g):
                    return True
                if time.monotonic() >= deadline:  # (every rank alive: the channel checked)
                    raise dag_calls.step_bound_error()
                return False
            try:
                return g.channel.read(ref, stop)
            except Exception as e:  # noqa: BLE001 — any worker failure ends the group
                self._fail(g, e)
        try:
            # A dead rank raises here within a slice (dag_calls.py); a long step is waited for.
            return g.caller.call(self._read_output, g, ref, g.reads)
        except Exception as e:  # noqa: BLE001 — any worker failure ends the group
            self._fail(g, e)

    def _dag_get(self, g: RankGroup, submitted: concurrent.futures.Future) -> StepResult:
        while g.unread_parks and g.unread_parks[0] is not submitted:
            self._dag_get(g, g.unread_parks.popleft())  # (None: a parked call's output)
        ref = submitted.result()  # done: submitted earlier on this same thread
        ahead = g.read_ahead.pop(id(ref), None)
        if ahead is not None and ahead[0] is ref:
            outputs = ahead[1]
        else:
            if g.unread is ref:
                g.unread = None
            outputs = self._read(g, ref)
        result = outputs[self._output_rank]
        if result is None:  # (a Park's output, or a lagged call's that followed none)
            return None
        self.rebuilds_without_step = 0
        return result.owned()  # (copied out of the channel's buffer: see StepResult.owned)

    @staticmethod
    def _given_up(g: RankGroup) -> bool:
        return g.stopped or g.dead is not None

    @staticmethod
    def _read_output(g: RankGroup, ref: Any, n: int) -> Any:
        """The `n`-th output of the graph: asleep until the output rank has finished that call
        (Ray's read spins, wakeup.py), then read."""
        import ray

        if g.finished is not None:
            g.finished.wait_for(n, lambda: g.stopped or g.dead is not None)
        return ray.get(ref, timeout=ray_timeout_s())
