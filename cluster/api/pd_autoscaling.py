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

`autoscaling_stats` is what an LLMServer replica reports (`LLMServer.record_autoscaling_stats`).
`role_autoscaling_config` checks a `pd` role's `autoscaling_config` before Ray starts
(cluster/api/pd_app.py): Serve's pydantic model ignores unknown keys and builds the policy only
in its controller, so a typo would be dropped and bad `policy_kwargs` would fail the deploy
there; here each is a ValueError naming the key. A role's config without a `policy`, or with a
`policy` that names no `policy_function`, gets its role's policy (`DEFAULT_TARGETS`, with that
policy's `policy_kwargs` over them); a `policy_function` of the user's own is left as it is.

Serve averages each replica's reports over `look_back_period_s` (its mean, by default), and a
replica pushes them every `metrics_interval_s` (10 s by default): a config that should react
within seconds shortens both.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from ray.serve.config import AutoscalingConfig

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


POLICY_FUNCTION = f"{__name__}:RoleAutoscalingPolicy"
POLICY_KEYS = ("policy_function", "policy_kwargs")


def role_autoscaling_config(role: str, auto: Any) -> dict[str, Any]:
    """A `pd` role's autoscaling_config with its role's policy filled in (module docstring);
    ValueError naming the key at fault (the caller prefixes the role)."""
    if not isinstance(auto, dict):
        raise ValueError(f"autoscaling_config must be a mapping of Serve's autoscaling keys; "
                         f"got {auto!r}")
    unknown = sorted(set(auto) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise ValueError(f"autoscaling_config has unknown key(s) {unknown}; Serve's keys: "
                         f"{sorted(AutoscalingConfig.model_fields)}")
    policy = auto.get("policy", {})
    if not isinstance(policy, dict) or not set(policy) <= set(POLICY_KEYS):
        raise ValueError(f"autoscaling_config.policy must be a mapping with the keys "
                         f"{list(POLICY_KEYS)}; got {policy!r}")
    if policy.get("policy_function", POLICY_FUNCTION) == POLICY_FUNCTION:
        kwargs = policy.get("policy_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ValueError(f"autoscaling_config.policy.policy_kwargs must be a mapping; "
                             f"got {kwargs!r}")
        kwargs = {**DEFAULT_TARGETS[role], **kwargs}
        RoleAutoscalingPolicy.check_kwargs(kwargs)
        auto = {**auto, "policy": {"policy_function": POLICY_FUNCTION, "policy_kwargs": kwargs}}
    try:
        AutoscalingConfig(**auto)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(k) for k in err["loc"])
        raise ValueError(f"autoscaling_config{'.' + where if where else ''}: "
                         f"{err['msg'].removeprefix('Value error, ')}") from None
    return auto


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class RoleAutoscalingPolicy:
    """Replicas a role needs for its load (see the module docstring); Serve bounds and delays
    the answer."""

    KWARGS = ("metric", "target_per_replica", "kv_usage_target")

    def __init__(self, metric: str, target_per_replica: float,
                 kv_usage_target: float | None = None) -> None:
        if metric not in (QUEUED_PROMPT_TOKENS, RUNNING_SEQS):
            raise ValueError(f"metric must be {QUEUED_PROMPT_TOKENS!r} or {RUNNING_SEQS!r}; "
                             f"got {metric!r}")
        if not _number(target_per_replica) or not target_per_replica > 0:
            raise ValueError(f"target_per_replica must be > 0; got {target_per_replica!r}")
        if kv_usage_target is not None and not (_number(kv_usage_target)
                                                and 0 < kv_usage_target <= 1):
            raise ValueError(f"kv_usage_target must be in (0, 1]; got {kv_usage_target!r}")
        self.metric = metric
        self.target = float(target_per_replica)
        self.kv_usage_target = kv_usage_target

    @classmethod
    def check_kwargs(cls, kwargs: dict[str, Any]) -> None:
        """ValueError naming a `policy_kwargs` key the policy does not take, or a bad value."""
        unknown = sorted(set(kwargs) - set(cls.KWARGS))
        if unknown:
            raise ValueError(f"autoscaling_config.policy.policy_kwargs has unknown key(s) "
                             f"{unknown}; {cls.__name__} takes {list(cls.KWARGS)}")
        try:
            cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"autoscaling_config.policy.policy_kwargs: {e}") from None

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        need = sum(metrics.get(self.metric, {}).values()) / self.target
        if self.kv_usage_target is not None:
            need = max(need, sum(metrics.get(KV_CACHE_USAGE, {}).values()) / self.kv_usage_target)
        return need, {}
