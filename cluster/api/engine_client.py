"""What the HTTP layer knows of an engine: `EngineClient` (the calls the routes make, to a local
engine object or to a remote LLMServer deployment), `ModelInfo` (what a model's routes check
requests against), and `LocalEngineClient` over an engine in this process (tests, offline use).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.engine.pooling import PoolingInfo
from scheduler.lora import LoRARequest
from scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class ModelInfo:
    model_name: str
    max_model_len: int
    max_num_seqs: int | None = None  # sequences per step: the most samples (n) one prompt may ask
    # SamplingParams fields a request that leaves them out gets (the engine's generation_config)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    pooling: PoolingInfo | None = None  # the pooling runner's (cluster/api/pooling_api.py)

    @classmethod
    def of(cls, engine: Any) -> ModelInfo:
        """An engine's (AsyncLLMEngine's attributes)."""
        return cls(engine.model_name, engine.max_model_len, engine.config.max_num_seqs,
                   dict(engine.default_sampling), engine.pooling)


class EngineClient(Protocol):
    """What the HTTP layer needs from an engine (local object or remote deployment)."""

    async def model_info(self) -> ModelInfo: ...

    def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 request_id: str, cache_salt: str | None = None,
                 routing_key: str | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[Any]: ...

    async def add_lora(self, lora_request: LoRARequest) -> None: ...

    async def remove_lora(self, lora_name: str) -> None: ...

    async def check_health(self) -> None: ...

    async def metrics(self) -> list[dict[str, Any]]: ...


class LocalEngineClient:
    """An `EngineClient` over an engine object in this process (AsyncLLMEngine's API)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def model_info(self) -> ModelInfo:
        return ModelInfo.of(self.engine)

    def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 request_id: str, cache_salt: str | None = None,
                 routing_key: str | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[Any]:
        return self.engine.generate(prompt_token_ids, sampling_params, request_id,
                                    cache_salt=cache_salt, lora_request=lora_request)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        self.engine.add_lora(lora_request)

    async def remove_lora(self, lora_name: str) -> None:
        self.engine.remove_lora(lora_name)

    async def check_health(self) -> None:
        self.engine.check_ready()

    async def metrics(self) -> list[dict[str, Any]]:
        return [self.engine.metrics()]
