"""Node loss under load on a simulated 3-node Ray cluster (ray.cluster_utils.Cluster, one host).

The head holds Serve's controller, the HeadOnly proxy and the ingress; two worker nodes hold
one LLMServer replica each (qwen3-tiny, tp 1, CPU). N greedy streams run at once; once each has
its first tokens, one worker node is killed (raylet and every process on it). Prints requests
lost, how many were resumed, p50/p99 end-to-end latency of all requests in the run with the
loss against the same run before it, and the seconds until a node that joins after the loss serves again
(full capacity). Fixed prompts; greedy outputs are checked against a run before the loss.

    source /work/bin/wt-env && python bench/node_loss.py --requests 16 --max-tokens 64 --json out.json
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
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import httpx
    import test_node_loss as t


    t.PROMPTS[:] = [f"Request {i}: the quick brown fox" for i in range(args.requests)]
    t.MAX_TOKENS = args.max_tokens
    with t.simulated_cluster() as sim:
        cluster, url = sim.cluster, sim.url
        t._deploy(t.ARGS)

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
        victim_replica = t._actors(t.REPLICA_CLASS)[0]
        victim = t._node_of(victim_replica)
        node = next(n for n in cluster.worker_nodes if n.node_id == victim)
        before = t._resumes_logged()
        killed_at = time.monotonic()
        got = asyncio.run(run(lambda: t.kill_node(cluster, node)))
        resumed = t._resumes_logged() - before
        t.add_node(cluster)  # (from the main thread: see sim_cluster.py)
        # (Serve counts the lost replica RUNNING until the GCS declares its node dead.)
        t._wait_for_replicas(2, gone_pid=victim_replica["Pid"])
        capacity_s = time.monotonic() - killed_at
        lost = sum(1 for g in got if isinstance(g, BaseException))
        wrong = sum(1 for g, r in zip(got, reference)
                    if not isinstance(g, BaseException) and g[0] != r[0])
        lat = sorted(g[1] for g in got if not isinstance(g, BaseException))
        base = sorted(r[1] for r in reference)

        def pct(xs: list[float], q: float) -> float:
            return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

        out = {"requests": args.requests, "max_tokens": args.max_tokens, "lost": lost,
               "outputs_differing": wrong, "resumed": resumed,
               "p50_s_with_node_loss": pct(lat, 0.5), "p99_s_with_node_loss": pct(lat, 0.99),
               "p50_s_before": pct(base, 0.5), "p99_s_before": pct(base, 0.99),
               "seconds_to_full_capacity": capacity_s}
        print("\n".join(f"{k:28s} {v}" for k, v in out.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
