"""The compiled graph's blocking calls (cluster/engine/dag_calls.py): a call is waited for in
slices while every rank lives, however long it takes up to STEP_BOUND_S; a dead rank (the GCS's
tables) or the bound ends the wait at once; a call's own error is its own.
"""

from __future__ import annotations

import threading
import time

import pytest

from cluster.engine import dag_calls
from cluster.engine.dag_calls import DagCaller, RankLostError, StepBoundError


@pytest.fixture(autouse=True)
def short_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dag_calls, "SLICE_S", 0.05)


class Probe:
    """A `dead` callback that says `why` from its `after`-th call on; counts its calls."""

    def __init__(self, why: str | None = None, after: int = 0) -> None:
        self.why, self.after, self.calls = why, after, 0

    def __call__(self) -> str | None:
        self.calls += 1
        return self.why if self.calls > self.after else None


def test_a_call_longer_than_many_slices_returns_its_value_with_every_rank_alive() -> None:
    probe = Probe()
    caller = DagCaller(probe)
    try:
        assert caller.call(lambda: time.sleep(0.5) or "step 3") == "step 3"
        assert probe.calls >= 5  # asked between slices, never judged dead
        assert caller.call(sorted, [3, 1, 2]) == [1, 2, 3]  # the next call, in order
    finally:
        caller.close()


def test_a_dead_rank_ends_the_wait_within_a_slice_of_the_probe_saying_so() -> None:
    release = threading.Event()
    caller = DagCaller(Probe("rank 1's actor is DEAD", after=3))
    start = time.monotonic()
    try:
        with pytest.raises(RankLostError, match="rank 1's actor is DEAD"):
            caller.call(release.wait, 60)
        assert time.monotonic() - start < 2
    finally:
        release.set()  # (the teardown's part: wake the abandoned call)
        caller.close()


def test_a_call_past_the_bound_with_every_rank_alive_fails_naming_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dag_calls, "STEP_BOUND_S", 0.3)
    release = threading.Event()
    caller = DagCaller(Probe())
    start = time.monotonic()
    try:
        with pytest.raises(StepBoundError, match=r"within STEP_BOUND_S = 0.3 s .*every rank is "
                           r"alive"):
            caller.call(release.wait, 60)
        assert 0.3 <= time.monotonic() - start < 2
    finally:
        release.set()
        caller.close()
    assert dag_calls.ray_timeout_s() == 0.3 + dag_calls._RAY_MARGIN_S  # Ray's: past the bound


def test_a_calls_own_error_is_raised_even_a_timeout_of_its_own() -> None:
    caller = DagCaller(Probe())

    def ray_timed_out() -> None:
        raise TimeoutError("RayChannelTimeoutError: increase RAY_CGRAPH_get_timeout")

    try:
        with pytest.raises(TimeoutError, match="RAY_CGRAPH_get_timeout"):
            caller.call(ray_timed_out)
        assert caller.call(int, "7") == 7  # the thread lives on
    finally:
        caller.close()


def test_dead_rank_reads_an_actor_killed_from_the_gcs(ray_cluster: None) -> None:
    import ray

    @ray.remote(num_cpus=0.01)
    class Rank:
        def ping(self) -> bool:
            return True

    ranks = [Rank.remote(), Rank.remote()]
    assert ray.get([r.ping.remote() for r in ranks]) == [True, True]
    assert dag_calls.dead_rank(ranks) is None
    ray.kill(ranks[1])
    deadline = time.monotonic() + 10
    while (why := dag_calls.dead_rank(ranks)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert why == "rank 1's actor is DEAD (the GCS's actor table)"
    ray.kill(ranks[0])
