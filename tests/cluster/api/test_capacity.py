"""A replica that cannot be placed says so: the app builder's report at deploy time (what one
replica needs against what each node has), and Serve's deployment message in `serve status`
within the time Serve waits before it says so (RAY_SERVE_SLOW_STARTUP_WARNING_S: 30 s by
default, 5 s in the tests' cluster, tests/cluster/conftest.py)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import yaml
from session_ports import free_port

from cluster.api.capacity import fit_report, group_needs, replicas_fitting

MANIFEST = Path(__file__).resolve().parents[3] / "manifests" / "qwen3-tiny.yaml"
TP2 = [{"CPU": 0.1}, {"CPU": 0.5}, {"CPU": 0.5}]  # the default manifest's replica
# Serve's wait, as the tests' cluster sets it (conftest) or Serve's default
SERVE_WAITS_S = int(os.environ.get("RAY_SERVE_SLOW_STARTUP_WARNING_S", 30))


def test_what_fits_on_what() -> None:
    assert group_needs(TP2) == {"CPU": 1.1}
    assert replicas_fitting({"CPU": 1.1}, {"CPU": 2.0}) == 1
    assert replicas_fitting({"CPU": 1.1, "GPU": 2.0}, {"CPU": 8.0, "GPU": 8.0}) == 4
    # the case: two tp-2 replicas on a 2-CPU machine, one fits
    report = fit_report(TP2, 2, {"CPU": 0.1}, [{"CPU": 2.0, "memory": 1e9}])
    assert report is not None
    assert report.startswith("LLMServer: 2 replica(s) asked, 1 fit this cluster: 1 will wait")
    assert "needs 1.1 CPU on one node" in report and "[{'CPU': 1.9}]" in report
    assert fit_report(TP2, 1, {"CPU": 0.1}, [{"CPU": 2.0}]) is None
    # two tp-1 replicas of 0.5 CPU each fit; a placement group never spans nodes
    assert fit_report([{"CPU": 0.5}], 2, {"CPU": 0.1}, [{"CPU": 2.0}]) is None
    assert "0 fit" in fit_report([{"CPU": 1.5}, {"CPU": 1.0}], 1, {}, [{"CPU": 2.0}] * 3)


def test_pipeline_stages_fit_on_several_nodes() -> None:
    """pp 2 x tp 2 of 1-CPU ranks: the first group (replica + stage 0) on one node, stage 1 on
    any node with 2 CPUs; two 2.5-CPU nodes hold one replica, not two."""
    from cluster.api.serve_app import placement_bundles, stage_bundles
    from cluster.engine.config import EngineConfig

    config = EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2, worker_num_cpus=1.0)
    first = placement_bundles(config, {"replica_num_cpus": 0.5}, use_gpu=False)
    stages = stage_bundles(config, use_gpu=False)
    assert first == [{"CPU": 0.5}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert stages == [[{"CPU": 1.0}, {"CPU": 1.0}]]
    nodes = [{"CPU": 2.5}, {"CPU": 2.5}]
    assert fit_report(first, 1, {}, nodes, stages) is None
    report = fit_report(first, 2, {}, nodes, stages)
    assert report.startswith("LLMServer: 2 replica(s) asked, 1 fit this cluster")
    assert "and 1 more pipeline stage(s) of 2 CPU each on one node, any" in report
    # one node of 4.5 CPUs holds both groups of one replica; stages need not be apart
    assert fit_report(first, 1, {}, [{"CPU": 4.5}], stages) is None
    assert "0 fit" in fit_report(first, 1, {}, [{"CPU": 2.5}, {"CPU": 1.5}], stages)


@pytest.mark.slow
def test_unplaceable_replica_is_in_serve_status_within_serves_wait(ray_cluster: None) -> None:
    from ray import serve

    from cluster.api.serve_app import build_app

    args = dict(yaml.safe_load(MANIFEST.read_text())["applications"][0]["args"])
    # 2 ranks x 8 CPUs: more than the cluster has. `pack`: Serve reserves the replica's whole
    # group, so its status names what is missing (`spread` reserves the ranks' group from the
    # replica: the build's fit report above says it, then the replica's start fails naming it)
    args.update(worker_num_cpus=8.0, replica_placement="pack")
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("ray.serve")
    logger.addHandler(handler)
    try:
        app = build_app(args)
    finally:
        logger.removeHandler(handler)
    assert any("0 fit this cluster" in m and "16.1 CPU on one node" in m for m in logged), logged

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    started = time.monotonic()
    serve._run(app, _blocking=False, name="unplaceable", route_prefix="/unplaceable")
    try:
        message = ""
        while time.monotonic() - started < SERVE_WAITS_S + 30:  # + the deploy itself, on a loaded machine
            status = serve.status().applications.get("unplaceable")
            if status is not None and "LLMServer" in status.deployments:
                message = status.deployments["LLMServer"].message
                if "to be scheduled" in message:
                    break
            time.sleep(1.0)
        assert "Resources required for each replica" in message, message
        assert '"CPU": 8.0' in message, message
        assert status.status in ("DEPLOYING", "UPDATING"), status.status
    finally:
        serve.delete("unplaceable")


@pytest.mark.slow
def test_ranks_without_room_fail_the_engine_naming_what_they_need(
        ray_cluster: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """`spread` (the default): the replica reserves its ranks' group itself; when no node has
    room for them together, its engine fails to start saying what they need (then Serve
    retries the replica) instead of waiting forever."""
    from cluster.engine import stage_placement
    from cluster.engine.ray_executor import RayExecutor
    from workers.config import WorkerConfig

    monkeypatch.setattr(stage_placement, "PLACEMENT_TIMEOUT_S", 2)
    config = WorkerConfig(model="unused: never loaded", tensor_parallel_size=2,
                          dist_init_method="tcp://127.0.0.1:1")
    with pytest.raises(RuntimeError, match=r"the 2 rank\(s\) of this engine found no node with "
                       r"room for them together within 2 s \(bundles \[\{'CPU': 8.0\}, "
                       r"\{'CPU': 8.0\}\], STRICT_PACK"):
        RayExecutor(config, num_cpus=8.0, use_gpu=False)
