"""Serve failover of a pipeline-parallel replica whose stage's node is lost and no node has
room for that stage again.

The simulated cluster (sim_cluster) has a head with no CPU and four 1-CPU worker nodes; two
LLMServer replicas at pipeline_parallel_size 2 (Ray executor) take 0.1 CPU each and 0.6 CPU
per stage rank. `spread` puts the replicas on two nodes, each with its stage 0 beside it
(0.7 of the node), which leaves no node room for a second 0.6 rank: each stage 1 fills one of
the other two nodes. Killing one replica's stage-1 node under HTTP streaming load leaves its
group nowhere to go (0.3, 0.3 and 0.4 CPU free): the engine gives up after
stage_placement.REBUILD_PLACEMENT_WAIT_S instead of stalling its streams for minutes, and
the ingress resumes them on the other replica. Pinned: every stream ends with the tokens the
same prompts got before the kill, 0 lost, in well under the minutes the old wait took; once a
spare node joins, Serve's replacement replica is placed on it (the dead engine's groups were
removed, not left pending) and both replicas serve again.
"""

from __future__ import annotations

import asyncio
import glob
import os
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest
from sim_cluster import Sim, add_node, alive_actors, kill_node, simulated_cluster
from sse_client import stream_completion

from cluster.engine.stage_placement import REBUILD_PLACEMENT_WAIT_S

pytestmark = pytest.mark.slow

APP = "ppfail"
REPLICA_CLASS = f"ServeReplica:{APP}:LLMServer"
MAX_TOKENS = 48
PROMPTS = [f"Request {i}: the quick brown fox" for i in range(8)]
DEPLOY_DEADLINE_S = 180.0
ARGS: dict[str, Any] = dict(
    model="qwen3-tiny", device="cpu", executor="ray", pipeline_parallel_size=2,
    tensor_parallel_size=1, swap_space=0.01, max_num_seqs=16, num_replicas=2,
    replica_num_cpus=0.1, worker_num_cpus=0.6,  # a node holds a replica and one stage rank
    ingress_num_cpus=0.0, ingress_on_head_node=True,
    health_check_period_s=1.0)  # Serve drops the dead engine's replica within seconds


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    from ray import serve

    from cluster.api.serve_app import build_app

    with simulated_cluster(node_cpus=(1, 1, 1, 1)) as sim:
        serve._run(build_app(ARGS), _blocking=False, name=APP, route_prefix="/")
        _wait_for_replicas(2, DEPLOY_DEADLINE_S)
        yield sim


def _node_of(actor: dict[str, Any]) -> str:
    return actor["Address"]["NodeID"]


def _wait_for_replicas(count: int, timeout: float, gone_pid: int | None = None) -> float:
    """Seconds until `count` LLMServer replicas are RUNNING and the app is (with `gone_pid`:
    and that replica's process has been replaced)."""
    from ray import serve

    start = time.monotonic()
    status = None
    while time.monotonic() - start < timeout:
        app = serve.status().applications.get(APP)
        if app is not None:
            status = app.deployments.get("LLMServer")
            pids = [a["Pid"] for a in alive_actors(REPLICA_CLASS)]
            if (status is not None and status.replica_states.get("RUNNING", 0) == count
                    and status.status == "HEALTHY" and app.status == "RUNNING"
                    and (gone_pid is None or (gone_pid not in pids and len(pids) == count))):
                return time.monotonic() - start
        time.sleep(0.5)
    raise AssertionError(f"LLMServer did not get to {count} replicas in {timeout:.0f} s: "
                         f"{status}")


async def _stream(client: httpx.AsyncClient, prompt: str, started: asyncio.Event | None = None
                  ) -> tuple[str, int, str | None]:
    """(text, usage.completion_tokens, finish_reason) of one greedy streamed completion."""
    return await stream_completion(client, prompt, MAX_TOKENS, started)


async def _all_streams(url: str, fail: Any = None) -> list[tuple]:
    """Every prompt streamed at once; with `fail`, called once each stream has its first
    tokens."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        started = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.create_task(_stream(client, p, e)) for p, e in zip(PROMPTS, started)]
        if fail is not None:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            await asyncio.to_thread(fail)
        return list(await asyncio.gather(*tasks))


def _ingress_lines(text: str) -> list[str]:
    """The ingress replicas' log lines holding `text` (the Serve replica logs)."""
    import ray

    logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    lines: list[str] = []
    for path in glob.glob(os.path.join(logs, "serve", "replica_*OpenAIIngress*.log")):
        with open(path, errors="replace") as f:
            lines += [line for line in f if text in line]
    return lines


def _logged_at(line: str) -> float:
    """The POSIX time of a Serve log line ("WARNING 2026-11-26 20:55:44,996 ...", local)."""
    _, day, clock = line.split(" ", 3)[:3]
    return datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _layout() -> tuple[dict[str, str], dict[str, str]]:
    """{replica actor name: its node} and {a stage-1 rank's node: its replica's node} (the
    rank actors on a node with no replica; a rank's owner is the replica that started it)."""
    replicas = {a["Name"]: _node_of(a) for a in alive_actors(REPLICA_CLASS)}
    stage1 = {_node_of(a): a["OwnerAddress"]["NodeID"] for a in alive_actors("RayWorker")
              if _node_of(a) not in replicas.values()}
    return replicas, stage1


def _unplaced_groups() -> list[dict[str, Any]]:
    """Placement groups waiting for room (pending, or rescheduling after their node died)."""
    from ray.util import placement_group_table

    return [g for g in placement_group_table().values()
            if g["state"] in ("PENDING", "RESCHEDULING")]


@pytest.fixture(scope="module")
def reference(sim: Sim) -> list[tuple]:
    got = asyncio.run(_all_streams(sim.url))
    assert all(usage == MAX_TOKENS and reason == "length" for _, usage, reason in got)
    return got


def test_each_replica_and_its_stage_0_on_one_node_its_stage_1_on_another(sim: Sim) -> None:
    replicas, stage1 = _layout()
    ranks = sorted(_node_of(a) for a in alive_actors("RayWorker"))
    assert len(set(replicas.values())) == 2, replicas
    assert sorted(list(replicas.values()) + list(stage1)) == ranks  # stage 0 beside its replica
    assert sorted(stage1.values()) == sorted(replicas.values()), (replicas, stage1)


def test_stage_node_lost_with_no_room_its_requests_resume_elsewhere(
        sim: Sim, reference: list[tuple]) -> None:
    """Kill the node of one replica's stage 1 while every prompt streams: nothing has room for
    that stage, the engine gives up within REBUILD_PLACEMENT_WAIT_S (plus the GCS's time to
    declare the node dead), its streams resume on the other replica; every stream ends with
    the reference's text. Then a spare node joins and both replicas serve again."""
    _, stage1 = _layout()
    victim_node, owner_node = next(iter(stage1.items()))
    victim = next(n for n in sim.cluster.worker_nodes if n.node_id == victim_node)
    lost_pid = next(a["Pid"] for a in alive_actors(REPLICA_CLASS) if _node_of(a) == owner_node)
    survivor = {a["Pid"] for a in alive_actors(REPLICA_CLASS)} - {lost_pid}
    lost = len(_ingress_lines("its replica was lost"))
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.time())
        kill_node(sim.cluster, victim)

    got = asyncio.run(_all_streams(sim.url, kill))
    assert got == reference
    losses = _ingress_lines("its replica was lost")[lost:]
    assert losses, "no request was on the lost replica"
    assert "EngineDeadError" in losses[0], losses[0]  # the engine gave up; its actor lived
    # The streams stalled for the GCS to declare the node dead (5 s here), one rebuild's start
    # on it cancelled then, 1 s of backoff and the bounded wait; not for minutes (each of four
    # attempts waited up to PLACEMENT_TIMEOUT_S, 120 s, before).
    stalled = min(_logged_at(line) for line in losses) - killed_at[0]
    assert REBUILD_PLACEMENT_WAIT_S < stalled < REBUILD_PLACEMENT_WAIT_S + 20, stalled
    print(f"pp failover: the lost replica's streams resumed elsewhere {stalled:.1f} s after "
          "the kill")
    # A spare node: Serve's replacement replica and its two stages fit there and beside it,
    # since nothing of the dead engine's is left waiting for room.
    add_node(sim.cluster)
    took = _wait_for_replicas(2, 150, gone_pid=lost_pid)
    assert survivor < {a["Pid"] for a in alive_actors(REPLICA_CLASS)}  # served throughout
    assert _unplaced_groups() == []
    print(f"pp failover: back to 2 replicas {took:.1f} s after the spare node joined")
