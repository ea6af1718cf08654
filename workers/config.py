"""What one worker process needs to know: the engine builds a `WorkerConfig` per rank."""

from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("cpu", "cuda")
_BACKENDS = ("auto", "triton", "flash_attn", "torch")


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
    # speculative decoding's draft model, a resolved checkpoint directory (None: no draft)
    speculative_model: str | None = None
    # speculative decoding's k (0: off) and the most sequences a verify step holds (the
    # per-batch off switch): the verify CUDA graphs' shapes
    num_speculative_tokens: int = 0
    speculative_max_num_seqs: int = 0
    # LoRA: adapters held in device slots (0: no LoRA wrappers) and their largest rank
    max_loras: int = 0
    max_lora_rank: int = 0

    def __post_init__(self) -> None:
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
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise ValueError(f"rank must be in [0, tensor_parallel_size={self.tensor_parallel_size}); "
                             f"got {self.rank}")
        if self.tensor_parallel_size > 1 and not self.dist_init_method:
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
        if self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB; got {self.kv_offloading_size}")
