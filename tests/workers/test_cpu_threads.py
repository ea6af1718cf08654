"""A CPU rank's torch threads (workers/cpu_threads.py): the cores less one, split over the
ranks, at least one; an OMP_NUM_THREADS in the environment wins."""

from __future__ import annotations

import pytest
import torch

from workers.cpu_threads import model_threads, set_model_threads


@pytest.mark.parametrize(("cores", "tp", "threads"),
                         [(2, 1, 1), (2, 2, 1), (1, 1, 1), (16, 1, 15), (16, 2, 7), (4, 8, 1)])
def test_model_threads_leave_one_core_and_split_the_rest(cores: int, tp: int,
                                                         threads: int) -> None:
    assert model_threads(tp, environ={}, cores=cores) == threads


def test_omp_num_threads_wins() -> None:
    assert model_threads(1, environ={"OMP_NUM_THREADS": "3"}, cores=16) is None


def test_bad_tensor_parallel_size_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        model_threads(0, environ={}, cores=2)


def test_set_model_threads_applies_it(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    try:
        assert set_model_threads(1) == 2 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
