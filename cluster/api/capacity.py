"""Whether the LLMServer replicas a manifest asks for fit the Ray cluster, said in words.

A replica is one STRICT_PACK placement group (serve_app.placement_bundles): all its bundles
on one node, or it does not start; a pipeline-parallel replica's later stages are one more
STRICT_PACK group each, on any node (cluster/engine/stage_placement.py). Serve then waits for resources without an error, and says
so in `serve status` only after RAY_SERVE_SLOW_STARTUP_WARNING_S (30 s) — with the bundles
it needs but, for a placement group, an empty "total resources available". `fit_report`
is what the app builder logs at deploy time instead (the `serve run` console): what one
replica needs, what each node has, and how many replicas fit. It counts the nodes' total
resources, not what other actors hold right now, so it only ever errs towards "fits".
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def group_needs(bundles: list[dict[str, float]]) -> dict[str, float]:
    """One placement group's resources, summed over its bundles (it lands on one node)."""
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            if value:
                total[key] = total.get(key, 0.0) + float(value)
    return total


def replicas_fitting(needs: dict[str, float], node: dict[str, float]) -> int:
    """How many groups of `needs` one node's resources hold."""
    if not needs:
        return 0
    return min(math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in needs.items())


def _take(needs: dict[str, float], nodes: list[dict[str, float]]) -> bool:
    """Take `needs` from the first node that has them; whether one had."""
    for node in nodes:
        if replicas_fitting(needs, node) >= 1:
            for k, v in needs.items():
                node[k] = node.get(k, 0.0) - v
            return True
    return False


def stages_fitting(needs: dict[str, float], stage_needs: dict[str, float], num_stages: int,
                   nodes: list[dict[str, float]], num_replicas: int) -> int:
    """How many replicas of a first group `needs` and `num_stages` more groups of
    `stage_needs` (each on one node, any) the nodes hold, placed first-fit in turn."""
    nodes = [dict(n) for n in nodes]
    for placed in range(num_replicas):
        if not _take(needs, nodes) or not all(_take(stage_needs, nodes)
                                              for _ in range(num_stages)):
            return placed
    return num_replicas


def fit_report(bundles: list[dict[str, float]], num_replicas: int,
               ingress: dict[str, float], nodes: Iterable[dict[str, float]],
               stages: list[list[dict[str, float]]] | None = None) -> str | None:
    """None when `num_replicas` groups of `bundles` (and of each of `stages`: a pipeline's
    later stages, each group on a node of its own) and the ingress fit the `nodes` (each
    node's total resources); else a message with what is needed and what the cluster has."""
    nodes = [dict(n) for n in nodes]
    needs = group_needs(bundles)
    stages = stages or []
    # the ingress goes first, where it fits (it needs no placement group)
    for node in nodes:
        if all(node.get(k, 0.0) >= v for k, v in ingress.items()):
            for k, v in ingress.items():
                node[k] = node.get(k, 0.0) - v
            break
    if stages:
        fits = stages_fitting(needs, group_needs(stages[0]), len(stages), nodes, num_replicas)
    else:
        fits = sum(replicas_fitting(needs, n) for n in nodes)
    if fits >= num_replicas:
        return None
    have = [{k: round(v, 2) for k, v in n.items() if k in needs} for n in nodes]
    waiting = num_replicas - fits
    more = (f", and {len(stages)} more pipeline stage(s) of {_fmt(group_needs(stages[0]))} "
            f"each on one node, any (bundles {stages[0]})" if stages else "")
    return (f"LLMServer: {num_replicas} replica(s) asked, {fits} fit this cluster: {waiting} "
            f"will wait for resources (serve status says so after 30 s). Each replica needs "
            f"{_fmt(needs)} on one node (placement group bundles {bundles}){more}; the nodes "
            f"have {have} after the ingress's {_fmt(ingress)}. Lower num_replicas, "
            "tensor_parallel_size, pipeline_parallel_size, worker_num_cpus or replica_num_cpus, "
            "or add a node.")


def _fmt(resources: dict[str, Any]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in resources.items()) or "nothing"


def cluster_nodes() -> list[dict[str, float]]:
    """The alive nodes' total resources (ray must be initialized)."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
