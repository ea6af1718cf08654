"""The ingress's `EngineClient` over an LLMServer deployment (`HandleEngineClient`: streams
through a DeploymentHandle, resumed on another replica when one is lost, cluster/api/failover.py),
and the plain tuples a RequestOutput travels as between an LLMServer replica and the ingress
(`pack_output` / `unpack_output`: without the prompt, which the ingress has).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ray.serve.handle import DeploymentHandle

from cluster.api.drain import HANDOFF
from cluster.api.engine_client import ModelInfo
from cluster.api.failover import ReplicaDrainingError, resuming_stream
from scheduler.lora import LoRARequest
from scheduler.outputs import CompletionOutput, RequestOutput
from scheduler.sampling_params import SamplingParams


class HandleEngineClient:
    """The ingress's `EngineClient`: LLMServer replicas behind a DeploymentHandle."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle
        # The token stream goes over Serve's direct gRPC channel between replicas, with plain
        # pickle: it skips Ray's object store and cloudpickle, a few ms of TTFT per request.
        self.stream_handle = handle.options(stream=True, _by_reference=False,
                                            request_serialization="pickle",
                                            response_serialization="pickle")

    async def model_info(self) -> ModelInfo:
        return await self.handle.model_info.remote()

    def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 request_id: str, cache_salt: str | None = None,
                 routing_key: str | None = None,
                 lora_request: LoRARequest | None = None,
                 disaggregated: bool = False) -> AsyncIterator[Any]:
        """The request's deltas; resumed (under the same adapter) on another replica if the
        one serving it is lost (the request router has dropped that replica and its KV
        holdings). `disaggregated` (a decode deployment's, cluster/api/pd_app.py): the first
        attempt runs the prompt on the prefill role first; a resume recomputes it."""
        prefill_first = [disaggregated]

        def open_stream(resume_token_ids: list[int]) -> AsyncIterator[Any]:
            first, prefill_first[0] = prefill_first[0], False
            return self._generate(prompt_token_ids, sampling_params, request_id, cache_salt,
                                  routing_key, resume_token_ids or None, lora_request, first)
        return resuming_stream(open_stream, request_id, sampling_params.n)

    async def prefill(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                      request_id: str, cache_salt: str | None, routing_key: str | None,
                      lora_request: LoRARequest | None) -> tuple[RequestOutput, Any]:
        """A prefill deployment's part (LLMServer.prefill): its output and the KV's params."""
        packed, transfer = await self.handle.prefill.remote(
            prompt_token_ids, sampling_params, request_id, cache_salt,
            routing_key=routing_key, lora_request=lora_request)
        return unpack_output(request_id, prompt_token_ids, packed), transfer

    async def _generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                        request_id: str, cache_salt: str | None, routing_key: str | None,
                        resume_token_ids: list[int] | None,
                        lora_request: LoRARequest | None,
                        disaggregated: bool = False) -> AsyncIterator[Any]:
        gen = self.stream_handle.generate.remote(prompt_token_ids, sampling_params, request_id,
                                                 cache_salt, routing_key=routing_key,
                                                 resume_token_ids=resume_token_ids,
                                                 lora_request=lora_request,
                                                 disaggregated=disaggregated)
        finished = False
        try:
            async for packed in gen:
                if packed == HANDOFF:
                    raise ReplicaDrainingError(f"request {request_id}: its replica is draining")
                out = unpack_output(request_id, prompt_token_ids, packed)
                finished = out.finished
                yield out
        finally:
            if not finished:  # client gone or error: cancel the replica-side generator
                gen.cancel()

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Every running replica loads and checks the adapter (a replica started later loads
        it at its first request under it); the first replica's error if any fails."""
        await self._on_every_replica("add_lora", lora_request)

    async def remove_lora(self, lora_name: str) -> None:
        await self._on_every_replica("remove_lora", lora_name)

    async def _on_every_replica(self, method: str, *args: Any) -> None:
        results = await self.handle.broadcast(method, *args).results_async(return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def check_health(self) -> None:
        """Healthy while any replica is ready: one lost replica (its requests resume on the
        others) does not take the whole server out of a load balancer."""
        results = await self.handle.broadcast("ready").results_async(return_exceptions=True)
        if not results:
            raise RuntimeError("no LLMServer replica is running yet")
        if all(isinstance(r, BaseException) for r in results):
            raise results[0]

    async def metrics(self) -> list[dict[str, Any]]:
        """Every reachable replica's (a lost one is left out, not an error)."""
        results = await self.handle.broadcast("metrics").results_async(return_exceptions=True)
        snapshots = [r for r in results if not isinstance(r, BaseException)]
        if results and not snapshots:
            raise results[0]
        return snapshots


def pack_output(out: RequestOutput, replica_id: str | None = None) -> tuple:
    """A RequestOutput as plain tuples for the hop to the ingress, without the prompt.

    (finished, num_cached_tokens, ((index, token_ids, text, finish_reason, stop_reason,
    logprobs), ...), replica_id, prompt_logprobs, pooled); `unpack_output` inverts it given
    the request id and prompt.
    """
    return (out.finished, out.num_cached_tokens,
            tuple((c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
                  for c in out.outputs), replica_id, out.prompt_logprobs, out.pooled)


def unpack_output(request_id: str, prompt_token_ids: list[int], packed: tuple) -> RequestOutput:
    finished, num_cached_tokens, outputs, replica_id, prompt_logprobs, pooled = packed
    return RequestOutput(request_id, prompt_token_ids,
                         [CompletionOutput(*c) for c in outputs], finished, num_cached_tokens,
                         replica_id, prompt_logprobs, pooled)
