"""The Ray Serve application: an OpenAI ingress deployment in front of LLMServer replicas.

`build_app(args)` is the app builder a Serve config file names
(`import_path: cluster.api.serve_app:build_app`); `args` are the manifest's `args`:
every `EngineConfig` field (model, tensor_parallel_size, ...) plus the serving keys in
`SERVING_DEFAULTS` (replicas, autoscaling, overload limits, API key, CPU shares); or, for
several base models in one app, `models: [args of one model, ...]` beside the ingress's keys
(cluster/api/multi_model.py): one LLMServer deployment per model, one ingress for all.

One LLMServer replica (cluster/api/llm_server.py) is one tensor-parallel group: the replica
actor (`replica_num_cpus`) and one worker actor per rank (a GPU each on CUDA, `worker_num_cpus`
on CPU), all on one node.
`replica_placement` says how replicas find nodes. `spread` (the default): the replica actor
has no placement group, so Serve's SPREAD strategy puts replicas on different nodes while
nodes have room (three on two nodes: two and one; one node: all there), and the replica's
engine reserves its ranks' STRICT_PACK group with its own node as the soft target. `pack`:
Serve reserves one STRICT_PACK group per replica (bundle 0 the replica, bundles 1..tp the
ranks), so a replica gets all of it at once or does not start, and Ray packs the groups onto
few nodes. The ingress is a separate deployment (tokenizing and SSE scale apart
from the engines) that streams from LLMServer through a DeploymentHandle.

With `direct_streaming: true` there is no ingress deployment: the app is one `DirectLLMServer`
deployment whose replicas serve the OpenAI routes over their own engine
(cluster/api/direct_app.py, which says what that mode keeps and gives up).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig
from ray.serve.handle import DeploymentHandle

from cluster.api.direct_app import DIRECT_EXTRA_ONGOING, DirectLLMServer, check_direct_streaming
from cluster.api.handle_client import HandleEngineClient
from cluster.api.llm_server import LLMServer
from cluster.api.lora_models import LORA_SERVING_DEFAULTS, LoRAModels, check_lora_args, lora_modules
from cluster.api.multi_model import ModelDispatch, deployment_name, model_entries
from cluster.api.openai_api import create_model_app
from cluster.api.openai_errors import DEFAULT_RETRY_AFTER_S
from cluster.api.pd_app import PDEngineClient, pd_entries
from cluster.api.prefix_router import check_router_args, request_router_config
from cluster.api.serve_env import REPLICA_ENV_VARS, bind_replica_grpc_to_node_ip
from cluster.engine.config import EngineConfig

logger = logging.getLogger("ray.serve")

API_KEY_ENV = "QWEN3_SERVE_API_KEY"

SERVING_DEFAULTS: dict[str, Any] = {
    "served_model_name": None,   # the name clients send as `model`; default: the `model` arg
    "api_key": None,             # or the QWEN3_SERVE_API_KEY env var; None = no auth
    "num_replicas": 1,           # LLMServer replicas; ignored when autoscaling_config is set
    # How long Serve lets a stopping LLMServer replica finish its requests before killing it;
    # halfway, it hands the unfinished ones to another replica (cluster/api/drain.py).
    "graceful_shutdown_timeout_s": 10.0,
    # Serve calls each LLMServer replica's check_health (fails when its engine is dead or has
    # stalled for engine_stall_timeout_s) this often; three failures in a row, or one answer
    # slower than the timeout, and Serve replaces the replica.
    "health_check_period_s": 5.0,
    "health_check_timeout_s": 30.0,
    "autoscaling_config": None,  # Serve's dict, e.g. {min_replicas, max_replicas, target_ongoing_requests}
    "max_ongoing_requests": 64,  # per LLMServer replica, in the engine at once
    "max_queued_requests": 64,   # per caller, waiting for a replica; beyond: 503 + Retry-After
    "replica_num_cpus": 1.0,     # the LLMServer actor (bundle 0)
    # spread: replicas on different nodes while nodes have room (a node loss takes one); pack:
    # Serve reserves each replica's whole group at once and Ray packs them (fewer nodes)
    "replica_placement": "spread",
    "ingress_num_cpus": 1.0,
    "ingress_num_replicas": 1,
    "ingress_max_ongoing_requests": 1024,
    # How long a stopping ingress replica keeps its clients' streams (every redeploy replaces
    # the ingress: its bound arguments hold the LLMServer deployment). A client's connection
    # ends at its ingress, so a stream still running after this is cut: size it for the
    # longest answer (Serve's default, 20 s, cut ordinary streams during a rolling update).
    "ingress_graceful_shutdown_timeout_s": 600.0,
    # Pin the ingress to the head node, beside the proxy of `proxy_location: HeadOnly`, so a
    # node holding only LLM replicas can die without cutting a client's connection.
    "ingress_on_head_node": False,
    "max_request_body_bytes": None,  # beyond: 413; None = max(1 MiB, 32 bytes x max_model_len)
    # prefix_aware | power_of_two (Serve's default); None = prefix_aware when > 1 replica can run
    "request_router": None,
    "router_imbalance_abs": 8,   # a replica this many requests above the least loaded one ...
    "router_imbalance_rel": 1.5,  # ... and this many times its load gets no prefix-routed request
    "router_session_hold_s": 5.0,  # a session between turns counts as a request this long
    # The LLMServer replicas serve HTTP themselves (DirectLLMServer): no ingress deployment,
    # no hop between deployments per request (~3 ms less TTFT on a 2-core host, docs/
    # benchmarks.md); one model, no pd, no request router, no failover onto another replica.
    "direct_streaming": False,
    **LORA_SERVING_DEFAULTS,  # lora_modules, runtime loading, the resolver (lora_models.py)
}


# Beyond max_queued_requests (LLMServer) or ingress_max_ongoing_requests: 503 + Retry-After.
BACKPRESSURE = BackpressureConfig(status_code=503, retry_after_s=DEFAULT_RETRY_AFTER_S)
PLACEMENTS = ("spread", "pack")
HEAD_NODE_RESOURCE = "node:__internal_head__"
HEAD_NODE_SHARE = 0.001  # of it per ingress replica: up to 1000 of them fit on the head

# A stopping replica checks for unfinished requests every SHUTDOWN_POLL_S (Serve's default:
# 2 s, the least it waits even when idle): part of how long Ctrl-C on `./dev serve` takes.
SHUTDOWN_POLL_S = 0.5


@serve.deployment(max_ongoing_requests=SERVING_DEFAULTS["ingress_max_ongoing_requests"],
                  graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
@serve.ingress()
class OpenAIIngress:
    """HTTP in, SSE out; tokenization and the chat template happen here. One OpenAI app per
    base model (`model_app`, over its LLMServer deployment); with several, `ModelDispatch`
    picks one by the request's `model` and checks the API key once for all."""

    def __init__(self, models: list[tuple[DeploymentHandle, dict[str, Any]]],
                 api_key: str | None = None) -> None:
        bind_replica_grpc_to_node_ip()
        self.api_key = api_key
        self.apps = [model_app(handle, spec, api_key if len(models) == 1 else None)
                     for handle, spec in models]

    def __serve_build_asgi_app__(self) -> Any:
        return self.apps[0] if len(self.apps) == 1 else ModelDispatch(self.apps, self.api_key)


def model_app(llm_server: DeploymentHandle, spec: dict[str, Any], api_key: str | None) -> Any:
    """One base model's OpenAI app (`ingress_spec`'s keys) over its LLMServer deployment."""
    client = (PDEngineClient(*map(HandleEngineClient, llm_server))  # (prefill, decode)
              if isinstance(llm_server, tuple) else HandleEngineClient(llm_server))
    return create_model_app(client, spec, api_key)


def ingress_spec(config: EngineConfig, serving: dict[str, Any]) -> dict[str, Any]:
    """What the ingress needs of one model's manifest args (`model_app`)."""
    name = serving["served_model_name"] or config.model
    return {"model": config.model, "served_model_name": serving["served_model_name"],
            "max_request_body_bytes": serving["max_request_body_bytes"],
            "reasoning_parser": config.reasoning_parser,
            "tool_call_parser": config.tool_call_parser,
            "loras": LoRAModels(lora_modules(serving["lora_modules"], name),
                                serving["dynamic_lora_loading_path"],
                                serving["allow_runtime_lora_updating"])}


def split_args(args: dict[str, Any]) -> tuple[EngineConfig, dict[str, Any]]:
    """Manifest args -> (engine config, serving options); unknown keys -> ValueError."""
    serving = {k: args[k] if k in args else v for k, v in SERVING_DEFAULTS.items()}
    engine_args = {k: v for k, v in args.items() if k not in SERVING_DEFAULTS}
    try:
        config = EngineConfig.from_dict(engine_args)
    except ValueError as e:
        raise ValueError(f"{e}; serving keys: {sorted(SERVING_DEFAULTS)}") from None
    limit = serving["max_request_body_bytes"]
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 1024):
        raise ValueError("max_request_body_bytes must be an integer >= 1024 (bytes) or null "
                         f"(sized from max_model_len); got {limit!r}")
    for key in ("graceful_shutdown_timeout_s", "ingress_graceful_shutdown_timeout_s",
                "health_check_period_s", "health_check_timeout_s"):
        timeout = serving[key]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"{key} must be a number of seconds > 0; got {timeout!r}")
    if serving["replica_placement"] not in PLACEMENTS:
        raise ValueError(f"replica_placement must be one of {list(PLACEMENTS)}; got "
                         f"{serving['replica_placement']!r}")
    check_router_args(serving)
    check_direct_streaming(args, serving)
    check_lora_args(serving, config.enable_lora, serving["served_model_name"] or config.model)
    return config, serving


def placement_bundles(config: EngineConfig, serving: dict[str, Any],
                      use_gpu: bool) -> list[dict[str, float]]:
    """Bundle 0 for the replica actor, then one per rank of the first pipeline stage (or the
    replica's GPU in-process); `stage_bundles` are the later stages'."""
    replica = {"CPU": float(serving["replica_num_cpus"])}
    if not config.uses_ray:
        return [{**replica, "GPU": 1.0}] if use_gpu else [replica]
    return [replica] + [_rank_bundle(config, use_gpu)
                        for _ in range(config.tensor_parallel_size)]


def _rank_bundle(config: EngineConfig, use_gpu: bool) -> dict[str, float]:
    return {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": float(config.worker_num_cpus)}


def stage_bundles(config: EngineConfig, use_gpu: bool) -> list[list[dict[str, float]]]:
    """Each later pipeline stage's bundles, one per rank: its own STRICT_PACK group, on any
    node (cluster/engine/stage_placement.py); none at pipeline_parallel_size 1."""
    return [[_rank_bundle(config, use_gpu) for _ in range(config.tensor_parallel_size)]
            for _ in range(config.pipeline_parallel_size - 1)]


def check_args(args: dict[str, Any]) -> None:
    """build_app's checks of a manifest's args, without building the app (nor importing
    torch): `./dev serve` runs them before it starts Ray (scripts/serve_run.py)."""
    _entries(dict(args or {}))


def _entries(args: dict[str, Any]) -> list[tuple[EngineConfig, dict[str, Any]]]:
    """(config, serving) per model, or the prefill and decode roles' with `pd`."""
    if "pd" in args:
        entries = pd_entries(args, split_args)
    else:
        entries = model_entries(args, split_args)
    if ("pd" in args or "models" in args) and any(s["direct_streaming"] for _, s in entries):
        raise ValueError("direct_streaming serves one model from its LLMServer replicas; with "
                         f"{'pd' if 'pd' in args else 'models'} the app needs its ingress "
                         "deployment: drop direct_streaming")
    return entries


def _report_fit(bundles: list[dict[str, float]], serving: dict[str, Any],
                stages: list[list[dict[str, float]]]) -> None:
    """Log, in the `serve run` console, when the replicas asked for cannot all be placed."""
    from cluster.api.capacity import cluster_nodes, fit_report

    auto = serving["autoscaling_config"] or {}
    replicas = (auto.get("initial_replicas") or auto.get("min_replicas") or 1 if auto
                else serving["num_replicas"])
    ingress = {"CPU": 0.0 if serving["direct_streaming"] else
               float(serving["ingress_num_cpus"]) * serving["ingress_num_replicas"]}
    report = fit_report(bundles, int(replicas), ingress, cluster_nodes(), stages)
    if report is not None:
        logger.warning(report)


def api_key(serving: dict[str, Any]) -> str | None:
    """The key clients must send: the manifest's `api_key`, else API_KEY_ENV's; None: no auth."""
    return serving["api_key"] or os.environ.get(API_KEY_ENV) or None


def build_app(args: dict[str, Any]) -> Application:
    """The Serve app builder named by the manifests (`cluster.api.serve_app:build_app`)."""
    entries = _entries(dict(args or {}))
    if "pd" in (args or {}):  # one model: (prefill, decode) deployments, the decode's spec
        (p, ps), (d, ds) = entries  # (the decode replicas call the prefill deployment)
        prefill = llm_deployment(p, ps, "LLMServer-prefill")
        models = [((prefill, llm_deployment(d, ds, "LLMServer-decode", prefill)),
                   ingress_spec(d, ds))]
    elif entries[0][1]["direct_streaming"]:
        (config, serving), = entries
        return llm_deployment(config, serving, deployment_name(config, serving, False),
                              ingress=ingress_spec(config, serving))
    else:
        models = [(llm_deployment(config, serving, deployment_name(config, serving,
                                                                   len(entries) > 1)),
                   ingress_spec(config, serving)) for config, serving in entries]
    serving = entries[0][1]  # (the ingress's keys are the same in every entry)
    ingress_actor: dict[str, Any] = {"num_cpus": float(serving["ingress_num_cpus"]),
                                     "runtime_env": {"env_vars": REPLICA_ENV_VARS}}
    if serving["ingress_on_head_node"]:  # (Ray gives the head node this resource, amount 1)
        ingress_actor["resources"] = {HEAD_NODE_RESOURCE: HEAD_NODE_SHARE}
    return OpenAIIngress.options(
        num_replicas=serving["ingress_num_replicas"],
        ray_actor_options=ingress_actor,
        max_ongoing_requests=serving["ingress_max_ongoing_requests"],
        graceful_shutdown_timeout_s=float(serving["ingress_graceful_shutdown_timeout_s"]),
        backpressure_config=BACKPRESSURE,
    ).bind(models, api_key(serving))


def llm_deployment(config: EngineConfig, serving: dict[str, Any], name: str,
                   prefill: Application | None = None,
                   ingress: dict[str, Any] | None = None) -> Application:
    """One model's LLMServer deployment: its placement group, replicas and router (a pd
    app's decode deployment: bound to the prefill deployment, `prefill`); with `ingress`
    (`ingress_spec`'s keys), a DirectLLMServer deployment that is the app's ingress."""
    from cluster.engine.ray_executor import worker_env

    # The replica may land on any node: ask the cluster (when connected), not this process.
    use_gpu = config.resolve_device(from_ray=ray.is_initialized()) == "cuda"
    bundles = placement_bundles(config, serving, use_gpu)
    if ray.is_initialized():  # (Serve's controller builds the app in a task: always)
        _report_fit(bundles, serving, stage_bundles(config, use_gpu))
    replicas: dict[str, Any] = {"num_replicas": serving["num_replicas"]}
    if serving["autoscaling_config"]:
        replicas = {"autoscaling_config": serving["autoscaling_config"]}
    router = None if ingress is not None else request_router_config(serving, config.block_size)
    if router is not None:
        replicas["request_router_config"] = router
    # With the in-process executor the replica runs the model itself, so it starts with what a
    # worker actor would (on a CPU, OpenMP threads that sleep when idle).
    llm_env = {**REPLICA_ENV_VARS, **worker_env("cuda" if use_gpu else "cpu")}
    if serving["replica_placement"] == "pack":
        replicas.update(placement_group_bundles=bundles, placement_group_strategy="STRICT_PACK")
    ongoing, queued = serving["max_ongoing_requests"], serving["max_queued_requests"]
    bound_kwargs: dict[str, Any] = {}
    if ingress is None:
        deployment, bound = serve.deployment(LLMServer), (config.to_dict(), prefill)
    else:  # (the replica's own gate keeps the limits: Serve's sit above them)
        deployment = serve.deployment(serve.ingress()(DirectLLMServer))
        bound = (config.to_dict(), ingress, api_key(serving))
        bound_kwargs = {"limits": (ongoing, queued)}
        ongoing += max(queued, 0) + DIRECT_EXTRA_ONGOING
    return deployment.options(
        name=name,
        ray_actor_options={"num_cpus": bundles[0]["CPU"], "num_gpus": bundles[0].get("GPU", 0.0),
                           "runtime_env": {"env_vars": llm_env}},
        max_ongoing_requests=ongoing,
        max_queued_requests=queued,
        graceful_shutdown_timeout_s=float(serving["graceful_shutdown_timeout_s"]),
        health_check_period_s=float(serving["health_check_period_s"]),
        health_check_timeout_s=float(serving["health_check_timeout_s"]),
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        backpressure_config=BACKPRESSURE, **replicas,
    ).bind(*bound, **bound_kwargs)
