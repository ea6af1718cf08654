"""`./dev test`'s xdist schedule (tests/conftest.py `pytest_xdist_make_scheduler`): whole files
per worker, and the simulated-cluster files as one unit of work on one worker."""

from __future__ import annotations

from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling


def test_the_multinode_files_are_one_unit_and_other_files_their_own(
        pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pytestconfig.option, "dist", "loadfile")
    monkeypatch.setattr(pytestconfig.option, "numprocesses", 2, raising=False)
    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen"], raising=False)
    sched = pytestconfig.hook.pytest_xdist_make_scheduler(config=pytestconfig, log=None)
    assert isinstance(sched, LoadFileScheduling)
    scopes = {nodeid: sched._split_scope(nodeid) for nodeid in (
        "tests/cluster/multinode/test_pipeline.py::test_a",
        "tests/cluster/multinode/test_node_loss.py::test_b[1]",
        "tests/cluster/api/test_http.py::test_c",
        "tests/cluster/api/test_http.py::TestD::test_e",
        "tests/kvcache/test_blocks.py::test_f")}
    assert scopes == {
        "tests/cluster/multinode/test_pipeline.py::test_a": "tests/cluster/multinode/",
        "tests/cluster/multinode/test_node_loss.py::test_b[1]": "tests/cluster/multinode/",
        "tests/cluster/api/test_http.py::test_c": "tests/cluster/api/test_http.py",
        "tests/cluster/api/test_http.py::TestD::test_e": "tests/cluster/api/test_http.py",
        "tests/kvcache/test_blocks.py::test_f": "tests/kvcache/test_blocks.py"}


def test_other_dist_modes_are_left_to_xdist(
        pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(__file__).parent / "conftest.py"
    conftest = next(p for p in pytestconfig.pluginmanager.get_plugins()
                    if getattr(p, "__file__", None) and Path(p.__file__) == root)
    for dist in ("load", "loadscope", "loadgroup", "each"):
        monkeypatch.setattr(pytestconfig.option, "dist", dist)
        assert conftest.pytest_xdist_make_scheduler(pytestconfig, None) is None
