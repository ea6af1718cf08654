"""The engine's rebuild policy after a rank died (engine_setup.rebuild_or_raise) and the wait
it puts on a lost stage's placement group (stage_placement.StagePlacement.wait_placed):
a failure is retried MAX_REBUILD_ATTEMPTS times, but a stage no node has room for ends the
engine after one wait of REBUILD_PLACEMENT_WAIT_S; either way the executor is shut down
(its placement groups removed) before the engine dies, so nothing of a dead engine's waits
for room that Serve's replacement replica needs.
"""

from __future__ import annotations

import pytest

from cluster.engine import engine_setup
from cluster.engine.engine_setup import MAX_REBUILD_ATTEMPTS, rebuild_or_raise
from cluster.engine.executor import WorkerDiedError
from cluster.engine.stage_placement import StagePlacement, StagesUnplacedError


class Rebuilds:
    """An executor whose `rebuild` raises each of `failures` in turn, then succeeds; it
    records every rebuild and shutdown called on it."""

    rebuilds_without_step = 0  # (as Executor: a real one zeroes it when a step completes)

    def __init__(self, *failures: BaseException) -> None:
        self.failures = list(failures)
        self.calls: list[str] = []

    def rebuild(self) -> None:
        self.calls.append("rebuild")
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_setup, "REBUILD_BACKOFF_S", 0.0)


def test_a_stage_no_node_has_room_for_ends_the_engine_after_one_wait() -> None:
    executor = Rebuilds(RuntimeError("cancelled: its node died"),
                        StagesUnplacedError("groups ['CREATED', 'RESCHEDULING'] not placed"))
    with pytest.raises(WorkerDiedError, match=r"rank 1 died; rebuilding the workers failed "
                       r"after 2 attempt\(s\): StagesUnplacedError: groups"):
        rebuild_or_raise(executor, WorkerDiedError("rank 1 died"))
    assert executor.calls == ["rebuild", "rebuild", "shutdown"]


def test_other_failures_are_retried_and_a_rebuild_that_succeeds_keeps_the_executor() -> None:
    executor = Rebuilds(RuntimeError("cancelled"), RuntimeError("cancelled"))
    rebuild_or_raise(executor, WorkerDiedError("rank 1 died"))
    assert executor.calls == ["rebuild"] * 3


def test_a_rebuild_failing_every_attempt_shuts_the_executor_down() -> None:
    executor = Rebuilds(*[RuntimeError(f"try {i}") for i in range(MAX_REBUILD_ATTEMPTS)])
    with pytest.raises(WorkerDiedError, match=f"after {MAX_REBUILD_ATTEMPTS} attempt.*try 3"):
        rebuild_or_raise(executor, WorkerDiedError("rank 1 died"))
    assert executor.calls == ["rebuild"] * MAX_REBUILD_ATTEMPTS + ["shutdown"]


def test_a_rebuilt_group_failing_again_before_any_step_counts_as_a_failed_attempt() -> None:
    """Each rebuild succeeds, but the new group dies on the same step (a step past the
    executor's bound, say): the engine ends after MAX_REBUILD_ATTEMPTS rebuilds, not in a loop."""
    executor = Rebuilds()
    for _ in range(MAX_REBUILD_ATTEMPTS):
        rebuild_or_raise(executor, WorkerDiedError("step 7 ran past the bound"))
    assert executor.calls == ["rebuild"] * MAX_REBUILD_ATTEMPTS
    with pytest.raises(WorkerDiedError, match=f"step 7 ran past the bound; the workers were "
                       f"rebuilt {MAX_REBUILD_ATTEMPTS} time\\(s\\) and each new group failed"):
        rebuild_or_raise(executor, WorkerDiedError("step 7 ran past the bound"))
    assert executor.calls == ["rebuild"] * MAX_REBUILD_ATTEMPTS + ["shutdown"]


def test_failed_rebuilds_and_failed_groups_share_the_attempts_until_a_step_completes() -> None:
    executor = Rebuilds(RuntimeError("cancelled"))
    rebuild_or_raise(executor, WorkerDiedError("rank 1 died"))  # 1 failed + 1 good rebuild
    assert executor.rebuilds_without_step == 2
    executor.rebuilds_without_step = 0  # a step completed on the new group
    rebuild_or_raise(executor, WorkerDiedError("rank 0 died"))
    assert executor.rebuilds_without_step == 1
    executor.failures = [RuntimeError(f"try {i}") for i in range(MAX_REBUILD_ATTEMPTS)]
    with pytest.raises(WorkerDiedError, match=f"after {MAX_REBUILD_ATTEMPTS} attempt.*try 2"):
        rebuild_or_raise(executor, WorkerDiedError("rank 0 died again"))
    assert executor.calls == ["rebuild"] * 6 + ["shutdown"]


def test_wait_placed_gives_up_on_a_group_with_no_room_and_remove_frees_it(
        ray_cluster: None) -> None:
    from ray.util import placement_group_table
    from ray.util.placement_group import placement_group

    group = placement_group([{"CPU": 1000.0}], strategy="STRICT_PACK")  # no node has room
    placement = StagePlacement([group], [0], [True], tp=1)
    try:
        with pytest.raises(StagesUnplacedError, match=r"\['PENDING'\], not placed within 1 s"):
            placement.wait_placed(timeout_s=1.0)
    finally:
        placement.remove()
    assert placement_group_table(group)["state"] == "REMOVED"
    placement.remove()  # (again: nothing left to remove)


def test_wait_placed_gives_up_at_once_on_a_removed_group(ray_cluster: None) -> None:
    """A group removed (its creator's job or node died) is never placed again: no wait."""
    import time

    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([{"CPU": 0.01}], strategy="STRICT_PACK")
    group.wait(30)
    remove_placement_group(group)
    placement = StagePlacement([group], [0], [False], tp=1)
    start = time.monotonic()
    with pytest.raises(StagesUnplacedError, match=r"\['REMOVED'\]: a removed group is never"):
        placement.wait_placed(timeout_s=30.0)
    assert time.monotonic() - start < 10


def test_room_for_sums_a_strict_pack_groups_bundles_on_one_node() -> None:
    from cluster.engine.stage_placement import room_for

    free = {"a": {"CPU": 1.0, "memory": 1e9}, "b": {"CPU": 0.5}}
    assert room_for([{"CPU": 0.5}, {"CPU": 0.5}], free)  # both on node a
    assert not room_for([{"CPU": 0.75}, {"CPU": 0.75}], free)  # 1.5 on no one node
    assert not room_for([{"CPU": 0.5, "GPU": 1.0}], free)  # no node has a GPU
    assert room_for([{"CPU": 0.5}], {"a": {"CPU": 0.5 - 1e-12}})  # float dust is room
    assert not room_for([{"CPU": 0.1}], {})


def test_wait_placed_waits_past_the_rebuild_wait_while_a_node_has_room(
        ray_cluster: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Room on an alive node means Ray is slow to move the group, not that it never will: the
    wait goes on to `room_timeout_s`. (The room is Ray's own figure but for the one field
    patched here: no node really fits 1000 CPUs, so the group stays pending.)"""
    import time

    from ray.util.placement_group import placement_group

    from cluster.engine import stage_placement

    real = stage_placement._available_per_node()
    assert real and all("CPU" in r for r in real.values())  # Ray's per-node figures
    assert not any("_group_" in k for r in real.values() for k in r)
    monkeypatch.setattr(stage_placement, "_available_per_node",
                        lambda: {n: {**r, "CPU": 1000.0} for n, r in real.items()})
    group = placement_group([{"CPU": 1000.0}], strategy="STRICT_PACK")
    placement = StagePlacement([group], [0], [True], tp=1)
    start = time.monotonic()
    try:
        with pytest.raises(StagesUnplacedError, match=r"not placed within 3 s of a rank's "
                           r"death although a node has room"):
            placement.wait_placed(timeout_s=0.5, room_timeout_s=3.0)
    finally:
        placement.remove()
    assert 3.0 < time.monotonic() - start < 10


def test_a_node_the_available_view_misses_counts_with_its_totals(
        ray_cluster: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GCS's available view can lag its node table (a live node missing from it, a dead one
    still in it): the room figures take the alive nodes of ray.nodes(), each at its available
    resources when the view has it and at its totals when not."""
    import ray
    from ray._private import state

    from cluster.engine import stage_placement

    (node,) = [n for n in ray.nodes() if n["Alive"]]
    monkeypatch.setattr(state, "available_resources_per_node",
                        lambda: {"a-dead-node": {"CPU": 8.0}})
    free = stage_placement._available_per_node()
    assert list(free) == [node["NodeID"]]
    assert free[node["NodeID"]]["CPU"] == node["Resources"]["CPU"]
    monkeypatch.setattr(state, "available_resources_per_node",
                        lambda: {node["NodeID"]: {"CPU": 0.25, "CPU_group_0_abc": 1.0}})
    assert stage_placement._available_per_node() == {node["NodeID"]: {"CPU": 0.25}}
