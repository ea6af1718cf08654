"""Each prefill/decode role scales on its own signal (cluster/api/pd_autoscaling.py): a
replica reports its engine's queued prompt tokens, running sequences and KV usage; a scripted
load (a burst of long prompts, then many long streams) through Serve's own policy wrapper
(factors, bounds, delays) scales the prefill role and not the decode role, then the other way
round; a `pd` manifest's autoscaling_config gets its role's policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from cluster.api.pd_app import pd_entries
from cluster.api.pd_autoscaling import (
    KV_CACHE_USAGE,
    QUEUED_PROMPT_TOKENS,
    RUNNING_SEQS,
    RoleAutoscalingPolicy,
    autoscaling_stats,
)
from cluster.api.serve_app import split_args

MANIFEST = Path(__file__).resolve().parents[3] / "manifests" / "qwen3-pd.yaml"
AUTO = {"min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 0, "downscale_delay_s": 0}


def _roles() -> dict[str, AutoscalingConfig]:
    args = dict(yaml.safe_load(MANIFEST.read_text())["applications"][0]["args"])
    for role in ("prefill", "decode"):
        args["pd"][role] = {**args["pd"][role], "autoscaling_config": AUTO}
    return {config.kv_role: AutoscalingConfig(**serving["autoscaling_config"])
            for config, serving in pd_entries(args, split_args)}


def _decide(config: AutoscalingConfig, current: int, metrics: dict[str, list[float]]) -> int:
    """What Serve's controller decides for a deployment of `current` replicas whose replicas
    report `metrics` (one value per replica)."""
    replicas = [f"r{i}" for i in range(current)]
    ctx = AutoscalingContext(
        deployment_id=None, deployment_name="LLMServer", app_name="qwen3",
        current_num_replicas=current, target_num_replicas=current, running_replicas=replicas,
        total_num_requests=float(current), total_queued_requests=0.0,
        aggregated_metrics={k: dict(zip(replicas, v)) for k, v in metrics.items()},
        raw_metrics={}, capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=None, config=config)
    decision, _ = _apply_autoscaling_config(_resolve_policy_callable(config.policy))(ctx)
    return int(decision)


def _replica(queued: float = 0.0, running: float = 0.0, kv: float = 0.0) -> dict[str, float]:
    return {QUEUED_PROMPT_TOKENS: queued, RUNNING_SEQS: running, KV_CACHE_USAGE: kv}


def _metrics(*replicas: dict[str, float]) -> dict[str, list[float]]:
    return {k: [r[k] for r in replicas] for k in replicas[0]}


def test_a_burst_of_long_prompts_scales_prefill_not_decode() -> None:
    roles = _roles()
    prefill = _metrics(_replica(queued=3 * 4096 + 1))
    decode = _metrics(_replica(running=6, kv=0.1))
    assert _decide(roles["prefill"], 1, prefill) == 4  # ceil(12289 / 4096), within max 4
    assert _decide(roles["decode"], 1, decode) == 1


def test_many_long_streams_scale_decode_not_prefill() -> None:
    roles = _roles()
    prefill = _metrics(_replica(queued=200), _replica(queued=0))
    decode = _metrics(_replica(running=40, kv=0.5), _replica(running=40, kv=0.6))
    assert _decide(roles["prefill"], 2, prefill) == 1  # the burst is over: back to the minimum
    assert _decide(roles["decode"], 2, decode) == 3  # 80 sequences over 32 each
    # a full KV cache needs room even with few sequences
    full = _metrics(_replica(running=4, kv=0.95), _replica(running=4, kv=0.9))
    assert _decide(roles["decode"], 2, full) == 3  # 1.85 of a cache over 0.8 each


def test_the_policy_refuses_bad_targets() -> None:
    with pytest.raises(ValueError, match="metric must be"):
        RoleAutoscalingPolicy("ongoing", 1)
    with pytest.raises(ValueError, match="target_per_replica must be > 0"):
        RoleAutoscalingPolicy(RUNNING_SEQS, 0)
    with pytest.raises(ValueError, match=r"kv_usage_target must be in \(0, 1\]"):
        RoleAutoscalingPolicy(RUNNING_SEQS, 8, kv_usage_target=2)


def test_a_role_with_its_own_policy_keeps_it() -> None:
    args: dict[str, Any] = dict(yaml.safe_load(MANIFEST.read_text())["applications"][0]["args"])
    mine = {"policy_function": "cluster.api.pd_autoscaling:RoleAutoscalingPolicy",
            "policy_kwargs": {"metric": RUNNING_SEQS, "target_per_replica": 2}}
    args["pd"]["prefill"] = {"autoscaling_config": {**AUTO, "policy": mine}}
    (_, serving), _ = pd_entries(args, split_args)
    assert serving["autoscaling_config"]["policy"] == mine


def test_a_replica_reports_its_engines_queue(tiny_model_path: str) -> None:
    from cluster.engine.config import EngineConfig
    from cluster.engine.llm_engine import LLMEngine
    from scheduler import SamplingParams

    engine = LLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=4, swap_space=0.01))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for i in range(2):
            engine.add_request(f"q{i}", [1000 + 100 * i + t for t in range(100)], params)
        assert autoscaling_stats(engine) == _replica(queued=200.0)
        engine.step()
        stats = autoscaling_stats(engine)
        assert stats[QUEUED_PROMPT_TOKENS] == 0 and stats[RUNNING_SEQS] == 2
        assert 0 < stats[KV_CACHE_USAGE] < 1
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.shutdown()


def _pd_args(**roles: dict[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = dict(yaml.safe_load(MANIFEST.read_text())["applications"][0]["args"])
    for role, over in roles.items():
        args["pd"][role] = over
    return args


@pytest.mark.parametrize("auto, message", [
    ({**AUTO, "upscale_dely_s": 1}, r"pd.decode: autoscaling_config has unknown key\(s\) "
                                     r"\['upscale_dely_s'\]"),
    ({**AUTO, "min_replicas": 3, "max_replicas": 2},
     r"pd.decode: autoscaling_config: max_replicas \(2\) must be greater than or equal to "
     r"min_replicas \(3\)"),
    ({**AUTO, "look_back_period_s": -1}, r"pd.decode: autoscaling_config.look_back_period_s: "
                                         r"Input should be greater than 0"),
    ({**AUTO, "policy": {"policy_kwargs": {"target": 8}}},
     r"pd.decode: autoscaling_config.policy.policy_kwargs has unknown key\(s\) \['target'\]; "
     r"RoleAutoscalingPolicy takes \['metric', 'target_per_replica', 'kv_usage_target'\]"),
    ({**AUTO, "policy": {"policy_kwargs": {"target_per_replica": "8"}}},
     r"pd.decode: autoscaling_config.policy.policy_kwargs: target_per_replica must be > 0; "
     r"got '8'"),
    ({**AUTO, "policy": {"policy_kwargs": {"kv_usage_target": 80}}},
     r"policy_kwargs: kv_usage_target must be in \(0, 1\]; got 80"),
    ({**AUTO, "policy": {"function": "x"}}, r"autoscaling_config.policy must be a mapping "
                                            r"with the keys \['policy_function', "
                                            r"'policy_kwargs'\]"),
    (4, r"pd.decode: autoscaling_config must be a mapping of Serve's autoscaling keys; got 4"),
])
def test_a_roles_bad_autoscaling_key_is_named(auto: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pd_entries(_pd_args(decode={"autoscaling_config": auto}), split_args)


def test_policy_kwargs_alone_tune_the_roles_own_policy() -> None:
    """A `policy` with kwargs and no function keeps the role's policy and its other
    targets; Serve itself would run its request-count policy on those kwargs."""
    tuned = {**AUTO, "policy": {"policy_kwargs": {"target_per_replica": 8}}}
    (_, prefill), (_, decode) = pd_entries(
        _pd_args(prefill={"autoscaling_config": tuned}, decode={"autoscaling_config": tuned}),
        split_args)
    fn = "cluster.api.pd_autoscaling:RoleAutoscalingPolicy"
    assert prefill["autoscaling_config"]["policy"] == {
        "policy_function": fn,
        "policy_kwargs": {"metric": QUEUED_PROMPT_TOKENS, "target_per_replica": 8}}
    assert decode["autoscaling_config"]["policy"] == {
        "policy_function": fn, "policy_kwargs": {"metric": RUNNING_SEQS,
                                                 "target_per_replica": 8,
                                                 "kv_usage_target": 0.8}}
