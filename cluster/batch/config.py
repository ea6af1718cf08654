"""`ProcessorConfig`: how a batch job runs its engines over a dataset (Ray Data LLM's
`vLLMEngineProcessorConfig`, smaller). Validated up front, so a bad value fails before Ray
starts an actor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.engine.config import EngineConfig


@dataclass(slots=True)
class ProcessorConfig:
    """One engine per actor of the engine stage's pool, each an `AsyncLLMEngine` of
    `engine_kwargs` (EngineConfig's fields; tensor_parallel_size > 1 starts that engine's own
    Ray workers in their own placement group).

    `concurrency`: the pool's size, fixed (n) or autoscaled between (min, max).
    `batch_size`: rows per batch handed to an engine actor; `max_batches_in_flight`: how many
    batches one actor works on at once, so its engine's free slots are refilled from the next
    batch while the rows of the last one finish (a batch comes back whole, once every row in
    it has). `engine_num_cpus` / `engine_num_gpus`: what each engine actor asks Ray for (its
    tensor-parallel workers, when tp > 1, ask for `worker_num_cpus` and a GPU each in their
    own placement group); `engine_num_gpus` None: 1 for a tp-1 engine when the Ray cluster has
    GPUs (its model runs in the actor), else 0. `max_restarts`: how often Ray
    restarts an engine actor whose process died; its unfinished batches run again.
    `apply_chat_template` / `tokenize`: the stages that turn `messages` rows into a prompt and
    `prompt` rows into token ids (off: the rows carry `prompt_token_ids` already); they and
    the pre- and postprocess functions run as at most `tokenizer_concurrency` tasks at once,
    `tokenizer_num_cpus` each.
    """

    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    concurrency: int | tuple[int, int] = 1
    batch_size: int = 32
    max_batches_in_flight: int = 4
    engine_num_cpus: float = 1.0
    engine_num_gpus: float | None = None
    max_restarts: int = 4
    apply_chat_template: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tokenize: bool = True
    tokenizer_num_cpus: float = 0.25
    tokenizer_concurrency: int = 1

    def __post_init__(self) -> None:
        self.engine_config()  # EngineConfig's own checks, with its messages
        c = self.concurrency
        if isinstance(c, list):
            c = self.concurrency = tuple(c)
        fixed = isinstance(c, int) and not isinstance(c, bool) and c >= 1
        ranged = (isinstance(c, tuple) and len(c) == 2
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in c)
                  and 1 <= c[0] <= c[1])
        if not (fixed or ranged):
            raise ValueError("concurrency must be an integer >= 1 (a fixed pool of engines) or "
                             f"(min, max) with 1 <= min <= max; got {self.concurrency!r}")
        for name, low in (("batch_size", 1), ("max_batches_in_flight", 1), ("max_restarts", 0),
                          ("tokenizer_concurrency", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
        for name in ("engine_num_cpus", "tokenizer_num_cpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be > 0; got {value!r}")
        gpus = self.engine_num_gpus
        if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, (int, float))
                                 or gpus < 0):
            raise ValueError(f"engine_num_gpus must be >= 0 or None (auto); got {gpus!r}")
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError("chat_template_kwargs must be a dict of the chat template's "
                             f"arguments; got {self.chat_template_kwargs!r}")

    def engine_config(self) -> EngineConfig:
        if not isinstance(self.engine_kwargs, dict):
            raise ValueError(f"engine_kwargs must be a dict of EngineConfig's fields; got "
                             f"{self.engine_kwargs!r}")
        return EngineConfig.from_dict(self.engine_kwargs)

    def engine_gpus(self, cluster_gpus: float) -> float:
        """The GPUs an engine actor asks for, on a cluster of `cluster_gpus` GPUs."""
        if self.engine_num_gpus is not None:
            return self.engine_num_gpus
        single = self.engine_config().tensor_parallel_size == 1
        return 1.0 if single and cluster_gpus >= 1 else 0.0

    @property
    def pool_size(self) -> tuple[int, int]:
        """(min, max) engines."""
        c = self.concurrency
        return (c, c) if isinstance(c, int) else c
