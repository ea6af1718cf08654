"""RayExecutor's groups of ranks (cluster/engine/rank_group.py, `RankGroup`): a group is stopped
once and never reused, so a call of a failed group that runs late (queued on its graph thread
behind the call that failed, or woken by the teardown) cannot touch the group a rebuild
started since; a second stop of a group waits for the first to finish; and a rendezvous that
a rank never reaches ends the start attempt at the bound.

The groups here hold stand-in ranks and graphs (no Ray actor is needed to show what a late
call touches); the last test waits on real Ray tasks.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from cluster.engine.executor import WorkerDiedError
from cluster.engine.rank_group import RankGroup
from cluster.engine.ray_executor import RayExecutor


class Graph:
    """A compiled graph's stand-in: records its calls; `teardown` takes `teardown_s`."""

    def __init__(self, teardown_s: float = 0.0) -> None:
        self.executed: list = []
        self.torn_down = threading.Event()
        self.teardown_s = teardown_s

    def execute(self, plan: object) -> str:
        self.executed.append(plan)
        return f"ref of {plan}"

    def teardown(self) -> None:
        time.sleep(self.teardown_s)
        self.torn_down.set()


class Caller:
    """DagCaller's stand-in: makes the call on the caller's thread."""

    def __init__(self) -> None:
        self.closed = False

    def call(self, fn, *args):  # noqa: ANN001, ANN201 — as DagCaller.call
        return fn(*args)

    def close(self) -> None:
        self.closed = True


def _group(name: str, graph: Graph | None = None) -> RankGroup:
    return RankGroup([f"{name} rank 0", f"{name} rank 1"],
                  concurrent.futures.ThreadPoolExecutor(1), caller=Caller(),
                  dag=graph or Graph())


def _executor(g: RankGroup) -> RayExecutor:
    ex = RayExecutor.__new__(RayExecutor)  # (no placement, no actors: the groups are stand-ins)
    ex._rdt, ex._lagged, ex._output_rank, ex._compiled_graph = None, False, 0, True
    ex._g = g
    return ex


def test_late_calls_of_a_failed_group_leave_the_group_started_since_alone() -> None:
    old, new = _group("old"), _group("new")
    ex = _executor(old)
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        ex._fail(old, RuntimeError("rank 1 died"))
    assert old.stopped and old.caller.closed and old.dag.torn_down.is_set()
    ex._g = new  # (what rebuild's _start does)

    # A submit queued on the old group's thread behind the call that failed runs now...
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        ex._dag_submit(old, "plan 8")
    # ...a read of a plan the old graph took before it failed...
    took = concurrent.futures.Future()
    took.set_result("ref of plan 7")
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        ex._dag_get(old, took)
    # ...and a call the teardown woke fails again, still on the old group.
    with pytest.raises(WorkerDiedError, match="rank 1 died"):
        ex._fail(old, RuntimeError("channel closed"))

    assert old.dag.executed == [] and new.dag.executed == []
    assert (new.dead, new.stopped, new.caller.closed) == (None, False, False)
    assert ex.workers == ["new rank 0", "new rank 1"]
    ex.check_health()  # the executor's group is the new one, alive


def test_the_executor_answers_from_its_current_group_only() -> None:
    old, new = _group("old"), _group("new")
    ex = _executor(old)
    with pytest.raises(WorkerDiedError):
        ex._fail(old, RuntimeError("rank 0 died"))
    with pytest.raises(WorkerDiedError, match="rank 0 died"):
        ex.check_health()
    assert ex.workers == []  # (a stopped group has no ranks to offer)
    ex._g = new
    ex.check_health()

    class Plan:
        step_id = 3

    plan = Plan()
    assert ex.submit(plan) == 3
    # (not lagged: the submit future of step 3 is kept for `result`, on the new group)
    assert new.calls[3].result(timeout=5) == f"ref of {plan}"
    assert new.dag.executed == [plan] and old.dag.executed == [] and old.calls == {}


def test_a_second_stop_of_a_group_waits_for_the_first_to_finish() -> None:
    g = _group("g", Graph(teardown_s=0.3))
    ex = _executor(g)
    first = threading.Thread(target=ex._stop, args=(g,))
    first.start()
    time.sleep(0.05)  # (the first stop is in the teardown)
    ex._stop(g)
    assert g.dag.torn_down.is_set() and g.stopped
    first.join()


def test_a_rendezvous_a_rank_never_reaches_fails_the_attempt_at_the_bound(
        ray_cluster: None) -> None:
    import ray

    @ray.remote(num_cpus=0)
    def join(wait_s: float) -> str:
        time.sleep(wait_s)
        return "joined"

    g = _group("g")
    ex = _executor(g)
    refs = [join.remote(0.0), join.remote(60.0)]
    assert ray.get(refs[0]) == "joined"  # (one rank is there; the other never comes)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"TimeoutError: 1 of 2 ranks did not join "
                                              r"their process group within 1 s"):
        ex._wait_all(g, refs, timeout_s=1.0, what="join their process group")
    assert time.monotonic() - start < 10
    assert g.stopped and g.dead is not None
    # (the ranks' stand-ins are strings: the stop's ray.kill of each is suppressed)
    ray.cancel(refs[1], force=True)


def test_a_serial_group_reads_each_call_before_it_writes_the_next(ray_cluster: None) -> None:
    """A driver that shares no node with its ranks makes one graph call at a time (Ray 2.60's
    cross-node channels hang now and then with two in flight): the second plan's write waits
    until the first call's outputs were read, and each step's `result` still gets its own."""
    import ray

    class Outputs(Graph):
        def __init__(self) -> None:
            super().__init__()
            self.read_before: list[int] = []  # calls read ahead when each call was written

        def execute(self, plan: object) -> object:
            self.executed.append(plan)
            self.read_before.append(len(g.read_ahead))
            return ray.put([Reply(plan.step_id), None])

    class Reply:
        def __init__(self, step_id: int) -> None:
            self.step_id = step_id

        def owned(self) -> int:
            return self.step_id

    class Plan:
        def __init__(self, step_id: int) -> None:
            self.step_id = step_id

    g = _group("g", Outputs())
    g.serial = True
    ex = _executor(g)
    ex.submit(Plan(1))
    ex.submit(Plan(2))  # (pp micro-batches: two plans submitted before any result)
    assert ex.result(1).result(timeout=30) == 1
    assert ex.result(2).result(timeout=30) == 2
    assert g.dag.read_before == [0, 1]  # the second write came after the first read
    assert g.read_ahead == {} and g.unread is None


def test_a_group_beside_its_driver_keeps_two_calls_in_flight(ray_cluster: None) -> None:
    import ray

    class Outputs(Graph):
        def execute(self, plan: object) -> object:
            self.executed.append(plan)
            return ray.put([plan.step_id, None])

    class Plan:
        def __init__(self, step_id: int) -> None:
            self.step_id = step_id

    g = _group("g", Outputs())
    ex = _executor(g)
    ex.submit(Plan(1))
    ex.submit(Plan(2))
    g.calls[2].result(timeout=30)
    assert len(g.dag.executed) == 2 and g.read_ahead == {} and g.unread is None
