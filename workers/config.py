"""What one worker process needs to know: the engine builds a `WorkerConfig` per rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.cpu_threads import check_cpu_nice

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("cpu", "cuda")
_BACKENDS = ("auto", "triton", "flash_attn", "torch")
# vLLM's kv_cache_dtype: "auto" is the model's dtype; "fp8" / "fp8_e4m3" store K and V as
# float8_e4m3fn divided by a per-tensor scale (1.0), half of bf16's bytes per block; the
# Triton and torch kernels read it, flash-attn does not.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# vLLM's load_format: "auto" reads the safetensors checkpoint; "dummy" fills the weights in
# place with random values, so a model runs from its config.json alone (workers/loader.py).
LOAD_FORMATS = ("auto", "dummy")


def check_kv_cache_dtype(kv_cache_dtype: str, attention_backend: str) -> None:
    """ValueError for an unknown kv_cache_dtype, or FP8 with the backend that cannot read it."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}; "
                         f"got {kv_cache_dtype!r}")
    if kv_cache_dtype != "auto" and attention_backend == "flash_attn":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not read by attention_backend "
                         "'flash_attn'; choose attention_backend 'auto', 'triton' or 'torch', "
                         "or kv_cache_dtype 'auto'")


POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(slots=True, frozen=True)
class PoolerConfig:
    """How a pooling runner pools (the engine fills it from the checkpoint's files)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    classify_token_ids: tuple[int, int] | None = None  # (no, yes): a yes/no reranker's score

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)}; "
                             f"got {self.pooling_type!r}")
        if self.classify_token_ids is not None and self.pooling_type != "LAST":
            raise ValueError("a yes/no reranker scores the last token; pooling_type must be "
                             f"'LAST', not {self.pooling_type!r}")

    @property
    def accumulates(self) -> bool:
        """Whether it needs every prompt position (no prefix cache)."""
        return self.pooling_type != "LAST"


@dataclass(slots=True)
class WorkerConfig:
    """One tensor-parallel rank's settings (vLLM's names and defaults).

    `model` is an already-resolved checkpoint directory. `dist_init_method` is
    "tcp://127.0.0.1:PORT" with a port the engine chose free; None only when tp == 1.
    `dtype` "auto" is float32 on CPU and the checkpoint's dtype on CUDA.
    `enable_expert_parallel`: a MoE model's ranks hold whole experts instead of a slice of
    every expert (workers/layers/moe.py); no effect on dense models or at tp 1.
    """

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    tensor_parallel_size: int = 1
    # pipeline parallelism (workers/pipeline.py): stages of tensor_parallel_size ranks each;
    # `rank` is the global one, in [0, pp x tp); the layers per stage ("3,1"; None: even)
    pipeline_parallel_size: int = 1
    pp_layer_partition: str | None = None
    rank: int = 0
    dist_init_method: str | None = None
    block_size: int = 16
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4.0
    kv_offloading_size: float = 0.0  # GiB of CPU offload tier for the whole replica (all ranks)
    enforce_eager: bool = False
    attention_backend: str = "auto"
    seed: int = 0
    enable_expert_parallel: bool = False
    cpu_nice: int = 0  # this rank's process's nice value (workers/cpu_threads.py)
    # the engine's process runs nothing else while the model computes (an offline LLM):
    # a wide enough model then takes every core (workers/cpu_threads.py)
    cpu_exclusive: bool = False
    # speculative decoding's draft model, a resolved checkpoint directory (None: no draft)
    speculative_model: str | None = None
    # speculative decoding's k (0: off) and the most sequences a verify step holds (the
    # per-batch off switch): the verify CUDA graphs' shapes
    num_speculative_tokens: int = 0
    speculative_max_num_seqs: int = 0
    # vLLM's hf_overrides: config.json keys set over the target checkpoint's (hf_config.py)
    hf_overrides: dict[str, Any] | None = None
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    # vLLM's quantization: None (the checkpoint's weights as they are) or "fp8" (a float
    # checkpoint quantized at load; workers/quantization.py)
    quantization: str | None = None
    load_format: str = "auto"  # LOAD_FORMATS (the target's; a draft loads its checkpoint)
    calculate_kv_scales: bool = False  # FP8 KV scales from the first step (workers/kv_scales.py)
    # LoRA: adapters held in device slots (0: no LoRA wrappers) and their largest rank
    max_loras: int = 0
    max_lora_rank: int = 0
    # the pooling runner's pooler (workers/pooler.py); None: the generate runner
    pooler: PoolerConfig | None = None

    @property
    def world_size(self) -> int:
        """Ranks of the replica: pipeline_parallel_size x tensor_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank that samples and returns the StepResult: the last stage's first."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def _check_pipeline(self) -> None:
        """ValueError for what pipeline parallelism does not run (yet), naming it."""
        refused = {"a draft-model speculative_config (its draft runs beside every target "
                   "layer)": self.speculative_model is not None}
        for what, on in refused.items():
            if on:
                raise ValueError(f"pipeline_parallel_size {self.pipeline_parallel_size} does "
                                 f"not support {what}; use pipeline_parallel_size 1")

    def __post_init__(self) -> None:
        check_cpu_nice(self.cpu_nice)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}; got {self.dtype!r}")
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}; got {self.device!r}")
        if self.attention_backend not in _BACKENDS:
            raise ValueError(f"attention_backend must be one of {_BACKENDS}; "
                             f"got {self.attention_backend!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be an integer >= 1; "
                             f"got {self.tensor_parallel_size!r}")
        if not isinstance(self.pipeline_parallel_size, int) or self.pipeline_parallel_size < 1:
            raise ValueError("pipeline_parallel_size must be an integer >= 1; "
                             f"got {self.pipeline_parallel_size!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, tensor_parallel_size x pipeline_parallel_size"
                             f"={self.world_size}); got {self.rank}")
        if self.world_size > 1 and not self.dist_init_method:
            raise ValueError("tensor_parallel_size > 1 needs dist_init_method "
                             "(e.g. 'tcp://127.0.0.1:29500' with a free port)")
        for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]; "
                             f"got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be >= 1 or None; "
                             f"got {self.num_gpu_blocks_override}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB; got {self.swap_space}")
        for name in ("num_speculative_tokens", "speculative_max_num_seqs", "max_loras",
                     "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0; got {value!r}")
        check_kv_cache_dtype(self.kv_cache_dtype, self.attention_backend)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}; "
                             f"got {self.load_format!r}")
        if self.pipeline_parallel_size > 1:
            self._check_pipeline()
        if self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB; got {self.kv_offloading_size}")
