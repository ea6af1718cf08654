"""Node loss under load on a simulated 3-node Ray cluster (ray.cluster_utils.Cluster, one host).

The head holds Serve's controller, the HeadOnly proxy and the ingress; two worker nodes hold
one LLMServer replica each (qwen3-tiny, tp 1, CPU). N greedy streams run at once; once each has
its first tokens, one worker node is killed (raylet and every process on it). Prints requests
lost, how many were resumed, p50/p99 end-to-end latency of all requests in the run with the
loss against the same run before it, the same split into the affected requests (those whose
stream started on the killed node's replica, from X-Replica-Id) and the unaffected ones, and
the seconds until a node that joins after the loss serves again (full capacity). Then a
rolling update under the same load: `serve deploy` of a changed engine config (max_num_seqs)
while waves of every prompt stream back to back until the new version is RUNNING; failures and
p50/p99 during it against the run before.
Fixed prompts; greedy outputs are checked against a run before any failure.

`--placement spread|pack --node-cpus 1,3` (issue #40) runs the same loss with each
`replica_placement` on worker nodes of those sizes (1,3: the 3-CPU node has room for both
replicas, so `pack` puts both there and `spread` one on each) and kills the node holding the
most replicas (ties: the bigger node); `--no-rolling-update` skips the rolling update.

    source /work/bin/wt-env && python bench/node_loss.py --requests 16 --max-tokens 64 --json out.json
    python bench/node_loss.py --placement pack --node-cpus 1,3 --no-rolling-update
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "cluster",
                                "multinode"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--placement", choices=("spread", "pack"), default=None,
                    help="replica_placement (default: the manifest default, spread)")
    ap.add_argument("--node-cpus", default="1,1",
                    help="CPUs of each simulated worker node, comma-separated")
    ap.add_argument("--no-rolling-update", action="store_true")
    args = ap.parse_args()
    node_cpus = tuple(int(c) for c in args.node_cpus.split(","))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import httpx
    import test_node_loss as t


    t.PROMPTS[:] = [f"Request {i}: the quick brown fox" for i in range(args.requests)]
    t.MAX_TOKENS = args.max_tokens
    deploy_args = dict(t.ARGS)
    if args.placement is not None:
        deploy_args["replica_placement"] = args.placement
    with t.simulated_cluster(node_cpus) as sim:
        cluster, url = sim.cluster, sim.url
        t._deploy(deploy_args)

        async def timed(client: httpx.AsyncClient, prompt: str, started: asyncio.Event):
            start = time.perf_counter()
            result = await t._stream(client, prompt, started)
            return result, time.perf_counter() - start

        async def run(fail) -> tuple[list, list[float]]:
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:
                started = [asyncio.Event() for _ in t.PROMPTS]
                tasks = [asyncio.create_task(timed(client, p, e))
                         for p, e in zip(t.PROMPTS, started)]
                await asyncio.gather(*(e.wait() for e in started))
                if fail is not None:
                    await asyncio.to_thread(fail)
                done = await asyncio.gather(*tasks, return_exceptions=True)
            return done

        reference = asyncio.run(run(None))
        replicas = t._actors(t.REPLICA_CLASS)
        by_node = [t._node_of(r) for r in replicas]
        sizes = {n.node_id: c for n, c in zip(cluster.worker_nodes, node_cpus)}
        # the node holding the most replicas (ties: the bigger node)
        victim = max(set(by_node), key=lambda n: (by_node.count(n), sizes.get(n, 0)))
        lost_replicas = [r for r, n in zip(replicas, by_node) if n == victim]
        lost_ids = {r["Name"].rsplit("#", 1)[-1] for r in lost_replicas}
        node = next(n for n in cluster.worker_nodes if n.node_id == victim)
        before = t._resumes_logged()
        killed_at = time.monotonic()
        got = asyncio.run(run(lambda: t.kill_node(cluster, node)))
        affected = [t.SERVED_BY.get(p) in lost_ids for p in t.PROMPTS]
        resumed = t._resumes_logged() - before
        t.add_node(cluster, num_cpus=sizes[victim])  # (from the main thread: sim_cluster.py)
        # (Serve counts the lost replica RUNNING until the GCS declares its node dead.)
        for lost in lost_replicas:
            t._wait_for_replicas(2, gone_pid=lost["Pid"])
        capacity_s = time.monotonic() - killed_at
        # A rolling update under the same load: a changed engine config replaces the replicas
        # one at a time (each hands its unfinished requests over as it stops).
        # Waves of every prompt run back to back from before the deploy until it is RUNNING,
        # so requests are in flight whenever Serve stops an old replica.
        async def rolling() -> tuple[list, list]:
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:
                async def wave() -> list:
                    return await asyncio.gather(*(timed(client, p, asyncio.Event())
                                                  for p in t.PROMPTS), return_exceptions=True)
                results, expected = await wave(), list(reference)
                deploy = asyncio.create_task(asyncio.to_thread(
                    t._deploy, {**t.ARGS, "max_num_seqs": 10}))
                while not deploy.done():
                    results += await wave()
                    expected += reference
                await deploy
            return results, expected

        update_before = t._losses_logged()
        updated, update_reference = ([], []) if args.no_rolling_update else asyncio.run(rolling())
        update_cut = t._losses_logged() - update_before

        def failed(results: list) -> int:
            return sum(1 for g in results if isinstance(g, BaseException))

        def differing(results: list, expected: list | None = None) -> int:
            return sum(1 for g, r in zip(results, expected or reference)
                       if not isinstance(g, BaseException) and g[0] != r[0])

        def pct(results: list, q: float, keep: list[bool] | None = None) -> float:
            xs = sorted(g[1] for i, g in enumerate(results) if not isinstance(g, BaseException)
                        and (keep is None or keep[i]))
            return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

        unaffected = [not a for a in affected]
        out = {"placement": deploy_args.get("replica_placement", "spread"),
               "node_cpus": list(node_cpus), "replicas_per_node": sorted(
                   (by_node.count(n) for n in set(by_node)), reverse=True),
               "replicas_lost": len(lost_replicas),
               "requests": args.requests, "max_tokens": args.max_tokens, "lost": failed(got),
               "outputs_differing": differing(got), "resumed": resumed,
               "affected": sum(affected),
               "p50_s_with_node_loss": pct(got, 0.5), "p99_s_with_node_loss": pct(got, 0.99),
               "p50_s_affected": pct(got, 0.5, affected),
               "p99_s_affected": pct(got, 0.99, affected),
               "p50_s_unaffected": pct(got, 0.5, unaffected),
               "p99_s_unaffected": pct(got, 0.99, unaffected),
               "p50_s_before": pct(reference, 0.5), "p99_s_before": pct(reference, 0.99),
               "seconds_to_full_capacity": capacity_s,
               "rolling_update_requests": len(updated),
               "rolling_update_failed": failed(updated),
               "rolling_update_outputs_differing": differing(updated, update_reference),
               "rolling_update_cut_by_shutdown": update_cut,
               "p50_s_during_rolling_update": pct(updated, 0.5),
               "p99_s_during_rolling_update": pct(updated, 0.99)}
        print("\n".join(f"{k:28s} {v}" for k, v in out.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
