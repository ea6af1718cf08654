"""`LLMServer`: one engine (one tensor-parallel group) as a Serve deployment's class; what the
ingress's handle calls (`generate` streams `pack_output` tuples, `prefill` for a pd app's
prefill role) and what Serve calls (health, autoscaling stats), plus the replica's metrics
export to Ray and the drain hand-off of a stopping replica's streams (cluster/api/drain.py).
cluster/api/serve_app.py makes its deployment (`llm_deployment`); a direct-streaming replica is
its subclass (cluster/api/direct_app.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.api.drain import Drain, watch_drain
from cluster.api.engine_client import ModelInfo
from cluster.api.handle_client import HandleEngineClient, pack_output
from cluster.api.pd_app import decode_after_prefill
from cluster.api.pd_autoscaling import autoscaling_stats
from cluster.api.serve_env import bind_replica_grpc_to_node_ip
from cluster.engine.config import EngineConfig
from scheduler.lora import LoRARequest
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")

# How often a replica pushes its engine metrics into ray.util.metrics.
METRICS_EXPORT_PERIOD_S = 5.0


class LLMServer:
    """One engine (one TP group). Streams `RequestOutput` deltas to the ingress (a Serve
    deployment of it: `llm_deployment`)."""

    def __init__(self, engine_args: dict[str, Any], prefill: DeploymentHandle | None = None,
                 hand_off: bool = True) -> None:
        """`prefill`: a pd app's decode replica's handle of the prefill deployment.
        `hand_off`: a stopping replica hands its unfinished streams to another one
        (cluster/api/drain.py); not where the replica serves HTTP itself (`DirectLLMServer`)."""
        import ray

        from cluster.api.prometheus import RayMetricsExporter
        from cluster.engine.async_llm_engine import AsyncLLMEngine

        bind_replica_grpc_to_node_ip()
        config = EngineConfig.from_dict(engine_args)
        self.engine = AsyncLLMEngine(config, placement_group=ray.util.get_current_placement_group())
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.prefill_role = None if prefill is None else HandleEngineClient(prefill)
        self._exporter = RayMetricsExporter(self.engine.model_name, replica_id=self.replica_id,
                                            role=config.kv_role or "colocated")
        self._export_task: asyncio.Task | None = None
        self._drain = Drain(self.engine.abort)
        if hand_off:
            watch_drain(self._drain.begin)

    def _ensure_exporter(self) -> None:
        if self._export_task is None or self._export_task.done():
            self._export_task = asyncio.get_running_loop().create_task(self._export_metrics())

    async def _export_metrics(self) -> None:
        while True:
            try:
                self._exporter.update(self.engine.metrics())
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                logger.exception("exporting engine metrics to Ray failed")
            await asyncio.sleep(METRICS_EXPORT_PERIOD_S)

    async def model_info(self) -> ModelInfo:
        self._ensure_exporter()
        return ModelInfo.of(self.engine)

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str, cache_salt: str | None = None,
                       routing_key: str | None = None,
                       resume_token_ids: list[int] | None = None,
                       lora_request: LoRARequest | None = None,
                       disaggregated: bool = False) -> AsyncIterator[tuple]:
        """Stream `pack_output` tuples (not RequestOutput: it repeats the whole prompt); the
        first names this replica; HANDOFF last when the request goes on elsewhere because this
        replica is draining (cluster/api/drain.py). `routing_key` is the request router's
        (prefix_router.py); `resume_token_ids`: the request comes from a lost or draining
        replica with these outputs (cluster/api/failover.py); `lora_request`: its adapter;
        `disaggregated`: a decode replica's request whose prompt the prefill role runs first
        (cluster/api/pd_app.py `decode_after_prefill`)."""
        # Serve cancels this generator when the caller goes away; the engine's generator
        # then aborts the request in its `finally`, freeing its blocks within a step.
        self._ensure_exporter()

        async def packed() -> AsyncIterator[tuple]:
            replica_id = self.replica_id
            outs = (decode_after_prefill(self.prefill_role, self.engine, prompt_token_ids,
                                         sampling_params, request_id, cache_salt, routing_key,
                                         lora_request) if disaggregated else
                    self.engine.generate(prompt_token_ids, sampling_params, request_id,
                                         cache_salt=cache_salt, resume_token_ids=resume_token_ids,
                                         lora_request=lora_request))
            async for out in outs:
                yield pack_output(out, replica_id)
                replica_id = None

        async for item in self._drain.stream(request_id, sampling_params.n, packed):
            yield item

    async def prefill(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                      request_id: str, cache_salt: str | None = None,
                      routing_key: str | None = None,
                      lora_request: LoRARequest | None = None) -> tuple[tuple, Any]:
        """A prefill replica's part (cluster/api/pd_app.py): the request's one output packed,
        and its prompt's KV (`KVTransferParams`, None when its first token ended it)."""
        self._ensure_exporter()
        last = None
        async for out in self.engine.generate(prompt_token_ids, sampling_params, request_id,
                                               cache_salt=cache_salt, export_kv=True,
                                               lora_request=lora_request):
            last = out
        return pack_output(last, self.replica_id), last.kv_transfer_params

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics: this replica's load signals
        (cluster/api/pd_autoscaling.py; what a `pd` role's policy scales on)."""
        return autoscaling_stats(self.engine.engine)

    async def kv_events(self, cursors: dict[str, tuple[str | None, int]]) -> tuple:
        """(this replica's id, its KV events since its cursor in `cursors`, its load, its LoRA
        adapters): what PrefixAwareRouter polls (kvcache/events.py)."""
        epoch, seq = cursors.get(self.replica_id, (None, 0))
        return (self.replica_id, *self.engine.kv_events(epoch, seq), self.engine.lora_names())

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        self.engine.add_lora(lora_request)

    async def remove_lora(self, lora_name: str) -> None:
        self.engine.remove_lora(lora_name)

    async def metrics(self) -> dict[str, Any]:
        return {**self.engine.metrics(), "replica_id": self.replica_id}

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica: only when
        the engine is dead, not while it rebuilds its workers after one died."""
        self.engine.check_health()

    async def ready(self) -> None:
        """For /health: raises while the engine rebuilds its workers, or when it is dead."""
        self.engine.check_ready()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
