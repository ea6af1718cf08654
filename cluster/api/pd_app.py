"""Prefill/decode disaggregation as a Serve app (Ray Serve LLM's `build_pd_openai_app`): the
manifest's `pd` key, and the ingress's client that runs each request on both roles.

Manifest: one model's args as usual plus `pd: {prefill: {...}, decode: {...}}`, each role's
overrides of them (num_replicas or autoscaling_config, tensor_parallel_size, engine keys,
router keys). `pd_entries` turns them into two (EngineConfig, serving) pairs with `kv_role`
set (a role's `autoscaling_config` is checked key by key and, unless it names a policy
function of its own, gets its role's policy, scaling on its own signal:
cluster/api/pd_autoscaling.py); each becomes its own LLMServer deployment (`LLMServer-prefill`, `LLMServer-decode`),
and the ingress and its routes are the same as for one deployment.

The handshake, per request: the ingress opens one ordinary stream to the decode deployment
(`PDEngineClient.generate`; Serve's direct gRPC channel with plain pickle, as for colocated
serving), and the decode replica runs the rest (`decode_after_prefill`): the prefill
deployment's router (prefix-aware by default) picks a prefill replica, which runs the prompt
with max_tokens 1 and answers with its first token and the prompt's KV
(`LLMServer.prefill`, `KVTransferParams`: payloads in the object store,
cluster/engine/kv_transfers.py); the decode replica yields that token at once, then its
engine's stream, which starts from the transferred KV and the first token. The payloads'
refs go from the prefill replica (their owner) to the decode replica (the one reader) in that
call's answer and never through the ingress, so the token stream needs no ObjectRef: with
refs in it, the ingress's decode call went through Ray's object-ref streaming (every chunk
reported to the ingress's core worker), and every token of a disaggregated stream reached the
ingress later than a colocated one's, with a long tail (docs/benchmarks.md, prefill/decode).
Nothing is lost: a prefill replica lost before it answered -> the decode replica runs the
whole request; a payload lost after (the prefill replica died mid-transfer)
-> the decode engine computes the prompt itself; a decode replica lost mid-stream -> the
stream resumes on another decode replica with the tokens so far (the first token included),
as failover.py does for every request. A request counts against its decode replica's
max_ongoing_requests from its prefill on (the decode replica waits for the prefill's answer).
A request with n > 1, max_tokens 1 or prompt logprobs runs on the decode side alone.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from cluster.api.engine_client import ModelInfo
from cluster.api.failover import replica_lost
from cluster.api.pd_autoscaling import role_autoscaling_config
from cluster.engine.kv_transfers import prefill_sampling
from scheduler.lora import LoRARequest
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")

ROLES = ("prefill", "decode")


def pd_entries(args: dict[str, Any], split: Callable[[dict[str, Any]], tuple[Any, dict]]
               ) -> list[tuple[Any, dict[str, Any]]]:
    """[(prefill config, serving), (decode config, serving)] of a manifest with `pd`
    (`split`: serve_app's `split_args`); ValueError naming the role and key at fault."""
    pd = args["pd"]
    if "models" in args:
        raise ValueError("pd and models cannot be combined yet: serve one model disaggregated, "
                         "or several colocated")
    if not isinstance(pd, dict) or set(pd) != set(ROLES) or not all(
            isinstance(pd[r], dict) for r in ROLES):
        raise ValueError("pd must be a mapping with exactly the keys prefill and decode, each a "
                         "mapping of that role's overrides (num_replicas, tensor_parallel_size, "
                         f"...); got {pd!r}")
    base = {k: v for k, v in args.items() if k != "pd"}
    entries = []
    for role in ROLES:
        if "kv_role" in pd[role]:
            raise ValueError(f"pd.{role} sets kv_role; the role is the key it sits under")
        over = dict(pd[role])
        try:
            auto = over.get("autoscaling_config", base.get("autoscaling_config"))
            if auto is not None:  # the role's own signal
                over["autoscaling_config"] = role_autoscaling_config(role, auto)
            entries.append(split({**base, **over, "kv_role": role}))
        except ValueError as e:
            raise ValueError(f"pd.{role}: {e}") from None
    (p, ps), (d, ds) = entries
    for key in ("model", "tensor_parallel_size", "block_size", "kv_cache_dtype", "kv_transport"):
        if getattr(p, key) != getattr(d, key):
            raise ValueError(f"pd: prefill's {key} is {getattr(p, key)!r}, decode's "
                             f"{getattr(d, key)!r}; the KV moves block by block and rank by "
                             f"rank, so give both roles the same {key}")
    if (ps["served_model_name"] or p.model) != (ds["served_model_name"] or d.model):
        raise ValueError("pd: both roles serve one model; set served_model_name at the top "
                         "level, not per role")
    return entries


class PDEngineClient:
    """The ingress's `EngineClient` over a prefill and a decode deployment (HandleEngineClient
    each, handle_client.py); see the module docstring for the handshake."""

    def __init__(self, prefill: Any, decode: Any) -> None:
        self.prefill = prefill
        self.decode = decode

    async def model_info(self) -> ModelInfo:
        return await self.decode.model_info()

    def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 request_id: str, cache_salt: str | None = None,
                 routing_key: str | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[Any]:
        p = sampling_params
        whole = p.n != 1 or (p.max_tokens is not None and p.max_tokens < 2) \
            or p.prompt_logprobs is not None
        return self.decode.generate(prompt_token_ids, p, request_id, cache_salt, routing_key,
                                    lora_request, disaggregated=not whole)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        await self.prefill.add_lora(lora_request)
        await self.decode.add_lora(lora_request)

    async def remove_lora(self, lora_name: str) -> None:
        await self.prefill.remove_lora(lora_name)
        await self.decode.remove_lora(lora_name)

    async def check_health(self) -> None:
        """Healthy while each role has a ready replica."""
        await self.prefill.check_health()
        await self.decode.check_health()

    async def metrics(self) -> list[dict[str, Any]]:
        """Every reachable replica's of both roles (each snapshot names its `kv_role`)."""
        return [*await self.prefill.metrics(), *await self.decode.metrics()]


async def decode_after_prefill(prefill: Any, engine: Any, prompt_token_ids: list[int],
                               sampling_params: SamplingParams, request_id: str,
                               cache_salt: str | None, routing_key: str | None,
                               lora_request: LoRARequest | None) -> AsyncIterator[Any]:
    """A decode replica's disaggregated request (see the module docstring): `prefill` is its
    HandleEngineClient of the prefill deployment, `engine` its AsyncLLMEngine. The prefill's
    first token, then the decode engine's deltas."""
    if prefill is None:
        raise ValueError("a disaggregated request needs a decode replica of a pd app (one "
                         "started with the prefill deployment's handle); this replica has none")
    p = sampling_params
    args = (prompt_token_ids, p, request_id)
    kw = {"cache_salt": cache_salt, "lora_request": lora_request}
    try:
        first, transfer = await prefill.prefill(prompt_token_ids, prefill_sampling(p),
                                                request_id, cache_salt, routing_key,
                                                lora_request)
    except Exception as e:  # noqa: BLE001 - a lost prefill replica: decode does it all
        if not replica_lost(e):
            raise
        logger.warning("request %s: its prefill replica was lost (%s); the decode side "
                       "runs it whole", request_id, type(e).__name__)
        async for out in engine.generate(*args, **kw):
            yield out
        return
    if transfer is None:  # its first token ended it (a stop token or string)
        yield first
        return
    first.finished = False
    first.outputs[0].finish_reason = first.outputs[0].stop_reason = None
    yield first
    stream = engine.generate(*args, kv_transfer_params=transfer, **kw)
    transfer = None  # (the payloads' refs: the engine's stream holds them from here)
    async for out in stream:
        yield out
