"""Autoscaling 1 -> 3 -> 1 under a scripted load ramp on a simulated 3-node Ray cluster
(ray.cluster_utils.Cluster, one host), with Serve's autoscaler on target_ongoing_requests.

The cluster and the ramp are those of tests/cluster/multinode/test_node_loss.py: a head with
no CPU (controller, HeadOnly proxy, ingress) and two 1-CPU worker nodes; LLMServer replicas of
qwen3-tiny (tp 1, CPU, 0.5 CPU each) with min 1, max 3, target_ongoing_requests 2. N greedy
streams run over and over until 3 replicas serve, then one at a time until Serve is back to 1.
Prints: seconds from the scale-up decision (the deployment turns UPSCALING) to 3 replicas
RUNNING, from the ramp-down to the scale-down decision and to 1 replica, streams that ended
right, failed streams (goal 0), and resumes split into hand-offs by draining replicas and
losses (a replica killed before it handed its requests over). Outputs are checked against a
run of the same prompts on the fixed 2-replica deployment first.

    source /work/bin/wt-env && python bench/autoscale.py --requests 8 --max-tokens 48 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "cluster",
                                "multinode"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import httpx
    import test_node_loss as t

    from cluster.api.serve_env import apply_proxy_env

    apply_proxy_env()  # the HTTP front the tests and `./dev serve` run with
    t.PROMPTS[:] = [f"Request {i}: the quick brown fox" for i in range(args.requests)]
    t.MAX_TOKENS = args.max_tokens
    with t.simulated_cluster() as sim:
        url = sim.url
        t._deploy(t.ARGS)

        async def reference() -> list[tuple]:
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:
                return list(await asyncio.gather(*(t._stream(client, p) for p in t.PROMPTS)))

        ref = asyncio.run(reference())
        t._deploy(t.AUTOSCALED_ARGS)
        t._wait_for_replicas(1)
        resumes, losses = t._resumes_logged(), t._losses_logged()
        ramp = asyncio.run(t._load_ramp(url, ref, timeout=600))
        resumes, losses = t._resumes_logged() - resumes, t._losses_logged() - losses

        def span(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 2)

        out = {"requests": args.requests, "max_tokens": args.max_tokens,
               "autoscaling_config": t.AUTOSCALING,
               "s_upscale_decision_to_3_running": span(ramp.upscale_decided, ramp.upscaled),
               "s_ramp_down_to_downscale_decision": span(ramp.upscaled, ramp.downscale_decided),
               "s_ramp_down_to_1_running": span(ramp.upscaled, ramp.downscaled),
               "streams_ok": ramp.ok, "streams_failed": len(ramp.failed),
               "handed_over": resumes - losses, "lost_replica_resumes": losses,
               "failures": ramp.failed[:5]}
        print("\n".join(f"{k:36s} {v}" for k, v in out.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
