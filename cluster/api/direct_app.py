"""Direct streaming (`direct_streaming: true`): the LLMServer replica is the app's HTTP ingress.

`DirectLLMServer` serves the OpenAI routes over its own engine (`DirectEngineClient`): HAProxy,
or Serve's proxy, hands each HTTP request straight to a replica, whose routes tokenize, stream
from its engine and write SSE in the replica's process; no ingress deployment, no hop between
deployments per request or per streamed token. Serve's direct ingress still counts every
request on its replica (ongoing requests, autoscaling, the dashboard, a stopping replica's wait).

Invariants:
- The limits of the ingress's handle are kept by the replica's own gate (`Admission`):
  max_ongoing_requests in the engine, max_queued_requests waiting, any beyond refused with the
  ingress's OpenAI 503 and Retry-After (`ReplicaFullError`). Serve's own limits for the
  deployment sit DIRECT_EXTRA_ONGOING above (serve_app.llm_deployment), so Serve never answers
  first with its plain-text 503 and /health, /metrics still get in while the gate is full.
- One model, no pd, no request router, no failover or drain hand-off (the client's connection
  ends at the replica); `check_direct_streaming` refuses the keys that ask for them, and
  serve_app refuses `models` and `pd` with it.
- The adapter names a replica serves are its own (its routes' registry), so a runtime LoRA load
  or unload, which reaches the replica it was sent to, needs a deployment of one replica;
  `lora_modules` and `dynamic_lora_loading_path` work at any count.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from cluster.api.engine_client import LocalEngineClient, ModelInfo
from cluster.api.llm_server import LLMServer
from cluster.api.openai_api import create_model_app
from cluster.api.openai_errors import DEFAULT_RETRY_AFTER_S
from scheduler.lora import LoRARequest
from scheduler.sampling_params import SamplingParams

# A direct replica's Serve limits sit this far above its own gate's (max_ongoing + max_queued
# generation requests), so that /health, /metrics and /v1/models still get in while the gate is
# full, and an overloaded replica answers with its own OpenAI 503, not Serve's plain one.
DIRECT_EXTRA_ONGOING = 16


class ReplicaFullError(RuntimeError):
    """A direct replica's gate is full: HTTP 503 with Retry-After (openai_errors.map_exception)."""

    status_code = 503
    retry_after_s = DEFAULT_RETRY_AFTER_S


class Admission:
    """A direct replica's gate for generation requests, what Serve's handle gives the
    ingress's calls: `ongoing` in the engine at once, up to `queued` more waiting for one of
    their places (-1: no bound), any beyond refused (`ReplicaFullError`)."""

    def __init__(self, ongoing: int, queued: int) -> None:
        self.ongoing, self.queued = ongoing, queued
        self._places = asyncio.Semaphore(ongoing)
        self.held = 0  # requests running or waiting

    async def stream(self, open_stream: Callable[[], AsyncIterator[Any]]) -> AsyncIterator[Any]:
        """`open_stream()`'s items once a place is free; the place is given back when the
        stream ends, fails or is closed."""
        if self.queued >= 0 and self.held >= self.ongoing + self.queued:
            raise ReplicaFullError(f"this replica has {self.ongoing} running and {self.queued} "
                                   "queued requests (max_ongoing_requests, max_queued_requests)")
        self.held += 1
        try:
            async with self._places:
                async with contextlib.aclosing(open_stream()) as stream:
                    async for item in stream:
                        yield item
        finally:
            self.held -= 1


class DirectLLMServer(LLMServer):
    """An LLMServer replica that serves the OpenAI routes itself (`direct_streaming`): HAProxy
    (or Serve's proxy) hands each HTTP request straight to a replica, whose routes tokenize,
    stream from its own engine and write SSE in the replica's process, with no ingress
    deployment and no hop between deployments. One model, no pd; no request router (HAProxy
    balances the replicas), no failover or hand-off (a lost replica's streams end with it)."""

    def __init__(self, engine_args: dict[str, Any], spec: dict[str, Any],
                 api_key: str | None, limits: tuple[int, int]) -> None:
        """`limits`: the manifest's (max_ongoing_requests, max_queued_requests), kept by the
        replica's own gate (`Admission`)."""
        super().__init__(engine_args, hand_off=False)
        self.admission = Admission(*limits)
        self._app = create_model_app(DirectEngineClient(self), spec, api_key)

    def __serve_build_asgi_app__(self) -> Any:
        return self._app


class DirectEngineClient(LocalEngineClient):
    """The routes' `EngineClient` in a `DirectLLMServer`: this replica's engine, through its
    gate, with the replica's id on each stream and its metrics export kept running."""

    def __init__(self, server: LLMServer) -> None:
        super().__init__(server.engine)
        self.server = server

    async def model_info(self) -> ModelInfo:
        self.server._ensure_exporter()
        return await super().model_info()

    def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 request_id: str, cache_salt: str | None = None,
                 routing_key: str | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[Any]:
        self.server._ensure_exporter()
        opened = super().generate  # (zero-argument super() is not available in the lambda)
        return self._named(self.server.admission.stream(
            lambda: opened(prompt_token_ids, sampling_params, request_id, cache_salt,
                           routing_key, lora_request)))

    async def _named(self, outs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """The stream with this replica's id on its first output (the X-Replica-Id header)."""
        first = True
        async with contextlib.aclosing(outs):  # (a client gone: the engine aborts at once)
            async for out in outs:
                if first:
                    out.replica_id, first = self.server.replica_id, False
                yield out

    async def metrics(self) -> list[dict[str, Any]]:
        return [await self.server.metrics()]


# What a direct-streaming app has none of: an ingress deployment and a request router.
NOT_DIRECT_KEYS = ("ingress_num_cpus", "ingress_num_replicas", "ingress_max_ongoing_requests",
                   "ingress_graceful_shutdown_timeout_s", "ingress_on_head_node",
                   "request_router", "router_imbalance_abs", "router_imbalance_rel",
                   "router_session_hold_s")


def check_direct_streaming(args: dict[str, Any], serving: dict[str, Any]) -> None:
    """ValueError for a `direct_streaming` that is not a bool or comes with keys it has no
    use for; a direct replica left without `graceful_shutdown_timeout_s` gets the ingress's
    (its streams cannot be handed to another replica: Serve waits for them this long)."""
    direct = serving["direct_streaming"]
    if not isinstance(direct, bool):
        raise ValueError(f"direct_streaming must be true or false; got {direct!r}")
    if not direct:
        return
    extra = sorted(set(args) & set(NOT_DIRECT_KEYS))
    if extra:
        raise ValueError("direct_streaming: the LLMServer replicas serve HTTP themselves, with "
                         "no ingress deployment and no request router (HAProxy or Serve's proxy "
                         f"picks the replica); remove {extra}, or drop direct_streaming")
    auto = serving["autoscaling_config"] or {}
    most = auto.get("max_replicas", 1) if auto else serving["num_replicas"]
    if serving["allow_runtime_lora_updating"] and most != 1:
        raise ValueError("allow_runtime_lora_updating with direct_streaming needs one replica "
                         f"(num_replicas or autoscaling max_replicas; got {most}): each replica "
                         "keeps the adapter names it serves, and a runtime load registers its name "
                         "on the replica it was sent to only; use lora_modules or "
                         "dynamic_lora_loading_path")
    if "graceful_shutdown_timeout_s" not in args:
        serving["graceful_shutdown_timeout_s"] = serving["ingress_graceful_shutdown_timeout_s"]
