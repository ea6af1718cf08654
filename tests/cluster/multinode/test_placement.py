"""Where LLMServer replicas land on a simulated cluster of two unequal worker nodes (a head
with no CPU, a 1-CPU node and a 3-CPU node), each with room for every replica of a test, so
that only the placement policy (`replica_placement`, cluster/api/serve_app.py) decides:

- `spread` (the default): two replicas on two different nodes; three: two and one; a tp-2
  replica's rank actors on its own node (their STRICT_PACK group soft-targets it);
- `pack`: Serve's per-replica STRICT_PACK groups, which Ray's placement-group scheduler puts
  where the most room is left: both replicas on the bigger node (the issue's "a node has room
  for both, both land there");
- a pipeline-parallel replica (pp 2): stage 0's rank in the replica's group, stage 1's in a
  group of its own, on the other node when the first is full; it serves transformers' tokens.

Each deploy replaces the one before (one app); every replica serves a request.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sim_cluster import Sim, alive_actors, simulated_cluster

pytestmark = pytest.mark.slow

APP = "placement"
REPLICA_CLASS = f"ServeReplica:{APP}:LLMServer"
DEPLOY_DEADLINE_S = 180.0
# A quarter of a node's CPU per replica: each node has room for every replica of a test.
ARGS: dict[str, Any] = dict(
    model="qwen3-tiny", tensor_parallel_size=1, device="cpu", executor="inprocess",
    swap_space=0.01, max_num_seqs=4, replica_num_cpus=0.25, ingress_num_cpus=0.0,
    ingress_on_head_node=True)


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    with simulated_cluster(node_cpus=(1, 3)) as sim:
        yield sim


def _deploy(sim: Sim, args: dict[str, Any], replicas: int) -> list[str]:
    """Deploy `args` afresh; the node of each LLMServer replica, once all serve."""
    from ray import serve

    from cluster.api.serve_app import build_app

    if APP in serve.status().applications:
        serve.delete(APP)
    serve._run(build_app({**args, "num_replicas": replicas}), _blocking=False, name=APP,
               route_prefix="/")
    start = time.monotonic()
    while (status := serve.status().applications[APP].status) != "RUNNING":
        if time.monotonic() - start > DEPLOY_DEADLINE_S:
            raise AssertionError(f"app {APP} not RUNNING after {DEPLOY_DEADLINE_S:.0f} s: {status}")
        time.sleep(0.5)
    body = {"model": "qwen3-tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0.0}
    with httpx.Client(base_url=sim.url, timeout=60) as client:
        for _ in range(replicas):
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
    replica_actors = alive_actors(REPLICA_CLASS)
    assert len(replica_actors) == replicas
    return [a["Address"]["NodeID"] for a in replica_actors]


def test_spread_puts_two_replicas_on_two_nodes(sim: Sim) -> None:
    nodes = _deploy(sim, ARGS, 2)
    assert len(set(nodes)) == 2, nodes


def test_spread_puts_three_replicas_two_and_one(sim: Sim) -> None:
    nodes = _deploy(sim, ARGS, 3)
    assert sorted(Counter(nodes).values()) == [1, 2], nodes


def test_spread_keeps_each_tp2_group_beside_its_replica(sim: Sim) -> None:
    args = {**ARGS, "executor": "ray", "tensor_parallel_size": 2, "replica_num_cpus": 0.1,
            "worker_num_cpus": 0.2}
    nodes = _deploy(sim, args, 2)
    assert len(set(nodes)) == 2, nodes
    workers = [a["Address"]["NodeID"] for a in alive_actors("RayWorker")]
    assert sorted(workers) == sorted(nodes * 2), (nodes, workers)


def test_pack_puts_both_replicas_on_one_node(sim: Sim) -> None:
    nodes = _deploy(sim, {**ARGS, "replica_placement": "pack"}, 2)
    assert len(set(nodes)) == 1, nodes


def test_pp2_replica_serves_transformers_tokens_with_its_stages_on_two_nodes(sim: Sim) -> None:
    """`pack` at pipeline_parallel_size 2: the replica's group (the replica and stage 0's rank,
    3 CPUs) fills the 3-CPU node, so stage 1's own group goes to the other node; the
    replica answers over HTTP with transformers' greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.tiny_model import resolve_model

    args = {**ARGS, "executor": "ray", "pipeline_parallel_size": 2, "replica_placement": "pack",
            "replica_num_cpus": 2.0, "worker_num_cpus": 1.0}
    (node,) = _deploy(sim, args, 1)
    workers = [a["Address"]["NodeID"] for a in alive_actors("RayWorker")]
    assert len(workers) == 2 and node in workers and len(set(workers)) == 2, (node, workers)
    prompt = [151, 2000, 30000, 42, 7, 99999, 1234]
    path = resolve_model("qwen3-tiny")
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path).generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
    body = {"model": "qwen3-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True}
    r = httpx.post(f"{sim.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == AutoTokenizer.from_pretrained(path).decode(ref)


def test_an_unknown_placement_is_refused_naming_the_choices() -> None:
    from cluster.api.serve_app import check_args

    with pytest.raises(ValueError, match=r"replica_placement must be one of \['spread', 'pack'\]"):
        check_args({**ARGS, "replica_placement": "scatter"})
