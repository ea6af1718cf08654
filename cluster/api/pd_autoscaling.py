"""Each prefill/decode role scales on its own signal, so the P:D ratio follows the traffic.

Ray Serve (2.60) gives a deployment's replicas a `record_autoscaling_stats` hook (each
replica's numbers, pushed to the controller) and an autoscaling config a custom policy
(`autoscaling_config.policy: {policy_function, policy_kwargs}`; a class is built once with
the kwargs and called every tick with an `AutoscalingContext`). Serve's own wrapper then
applies upscaling/downscaling factors, min/max replicas and the up/down delays, so the
policy only says how many replicas the load needs:

  - prefill: the prompt tokens queued on every replica (waiting requests' uncached tokens
    and running prefills' rest) over `target_per_replica` tokens each;
  - decode: the running sequences over `target_per_replica` each, or the KV cache usage over
    `kv_usage_target` (a fraction of one replica's cache), whichever needs more.

`autoscaling_stats` is what an LLMServer replica reports (`LLMServer.record_autoscaling_stats`);
`default_policy` is what a `pd` role's `autoscaling_config` gets when it names no policy
(cluster/api/pd_app.py).
"""

from __future__ import annotations

from typing import Any

QUEUED_PROMPT_TOKENS = "queued_prompt_tokens"
RUNNING_SEQS = "running_seqs"
KV_CACHE_USAGE = "kv_cache_usage"

DEFAULT_TARGETS: dict[str, dict[str, Any]] = {
    "prefill": {"metric": QUEUED_PROMPT_TOKENS, "target_per_replica": 4096},
    "decode": {"metric": RUNNING_SEQS, "target_per_replica": 32, "kv_usage_target": 0.8},
}


def autoscaling_stats(engine: Any) -> dict[str, float]:
    """A replica's signals, from its LLMEngine (between steps, on the replica's loop)."""
    scheduler = engine.scheduler
    load, stats = scheduler.queues.load(), scheduler.stats()
    return {QUEUED_PROMPT_TOKENS: float(load.prompt_tokens),
            RUNNING_SEQS: float(stats.num_running_seqs),
            KV_CACHE_USAGE: float(stats.gpu_usage)}


def default_policy(role: str) -> dict[str, Any]:
    """The `policy` entry of a role's autoscaling_config (Serve's AutoscalingPolicy keys)."""
    return {"policy_function": f"{__name__}:RoleAutoscalingPolicy",
            "policy_kwargs": dict(DEFAULT_TARGETS[role])}


class RoleAutoscalingPolicy:
    """Replicas a role needs for its load (see the module docstring); Serve bounds and delays
    the answer."""

    def __init__(self, metric: str, target_per_replica: float,
                 kv_usage_target: float | None = None) -> None:
        if metric not in (QUEUED_PROMPT_TOKENS, RUNNING_SEQS):
            raise ValueError(f"metric must be {QUEUED_PROMPT_TOKENS!r} or {RUNNING_SEQS!r}; "
                             f"got {metric!r}")
        if not target_per_replica > 0:
            raise ValueError(f"target_per_replica must be > 0; got {target_per_replica!r}")
        if kv_usage_target is not None and not 0 < kv_usage_target <= 1:
            raise ValueError(f"kv_usage_target must be in (0, 1]; got {kv_usage_target!r}")
        self.metric = metric
        self.target = float(target_per_replica)
        self.kv_usage_target = kv_usage_target

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        need = sum(metrics.get(self.metric, {}).values()) / self.target
        if self.kv_usage_target is not None:
            need = max(need, sum(metrics.get(KV_CACHE_USAGE, {}).values()) / self.kv_usage_target)
        return need, {}
