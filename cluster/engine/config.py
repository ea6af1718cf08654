"""One configuration for the whole engine; a Serve manifest's `args` map onto it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cluster.engine.reasoning import REASONING_PARSERS
from cluster.engine.tool_parsers import TOOL_CALL_PARSERS
from scheduler.speculative import SpeculativeConfig
from workers.config import LOAD_FORMATS, check_kv_cache_dtype
from workers.cpu_threads import check_cpu_nice
from workers.quantization import check_quantization_arg

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_BACKENDS = ("auto", "triton", "flash_attn", "torch")
_EXECUTORS = ("auto", "inprocess", "ray")


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine needs; validated up front so a bad value fails before any work.

    Fields and defaults follow vLLM's `LLM(...)` arguments. `max_model_len=None` takes the
    checkpoint's `max_position_embeddings` (with YaRN: factor x its original context); `max_num_batched_tokens=None` takes
    max(max_model_len, 8192) so a whole prompt fits one step unless chunked.
    """

    model: str = "qwen3-tiny"
    tensor_parallel_size: int = 1
    # vLLM's key: stages of tensor_parallel_size ranks each, the layers split between them
    # (workers/pipeline.py); each stage's ranks on one node, the stages on any (Ray executor).
    pipeline_parallel_size: int = 1
    # layers per stage, "3,1" (vLLM's VLLM_PP_LAYER_PARTITION, which is read when this is
    # None); None and no variable: an even split, a remainder to the stages before the last
    pp_layer_partition: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # Prompt tokens a step that carries decodes may compute (scheduler/config.py); None: the
    # rest of max_num_batched_tokens. Bounds a decoding stream's wait while prompts prefill.
    max_mixed_prefill_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4.0
    # GiB of CPU memory per replica (split evenly over its ranks) for the tier that keeps the
    # prefix blocks the GPU evicts and loads them back on a hit (vLLM's key; 0: off). Its own
    # budget beside swap_space; it needs prefix caching (kvcache/offload.py).
    kv_offloading_size: float = 0.0
    enable_prefix_caching: bool = True
    # Prefill/decode disaggregation (cluster/engine/kv_transfers.py): "prefill" exports a
    # finished prompt's KV, "decode" imports it; None: colocated, no transfers. A decode side
    # falls back to computing the prompt when a payload is not fetched in
    # kv_transfer_timeout_s seconds.
    kv_role: str | None = None
    kv_transfer_timeout_s: float = 10.0
    # How payloads travel (cluster/engine/kv_transport.py): "object_store" (Ray's object store,
    # through host memory), "rdt" (Ray Direct Transport: NCCL on CUDA, gloo on CPU, between the
    # Ray executor's ranks; cluster/engine/rdt_transport.py), None: rdt on CUDA when it can run
    # there, else object_store.
    kv_transport: str | None = None
    preemption_mode: str | None = None
    seed: int = 0
    enforce_eager: bool = False
    attention_backend: str = "auto"
    executor: str = "auto"
    worker_num_cpus: float = 1.0
    # The nice value (0-19) of the engine's worker processes (the replica's own process with
    # the in-process executor): a lower CPU priority, so that on shared cores the processes at
    # nice 0 run first. A prefill/decode app gives its prefill role 10 on CPU
    # (manifests/qwen3-pd.yaml): a burst of prompts then yields the cores to the decode
    # streams, whose steps are short and latency-bound (workers/cpu_threads.py).
    cpu_nice: int = 0
    # The process runs nothing else while the model computes (what `LLM` sets: offline,
    # synchronous steps): a wide enough model then takes every core on CPU, none left
    # to the engine's Python (workers/cpu_threads.py). False: one core is left.
    cpu_exclusive: bool = False
    # Ray executor: plans through one persistent channel (host_channel.py for ranks on the
    # engine's host, else a Ray Compiled Graph); False: one actor call per rank
    compiled_graph: bool = True
    # Schedule step N+1 while step N runs (its decodes take N's tokens on the workers), as
    # vLLM's async scheduling does; False: schedule only after each step's result is applied.
    # None: on with CUDA, where the forward pass leaves the host CPU free; off on CPU, where
    # scheduling ahead takes cycles from the forward pass it overlaps (measured in
    # docs/benchmarks.md: slower at tp 1 and tp 2 on the 2-core CI machine).
    async_scheduling: bool | None = None
    max_waiting_requests: int | None = None  # beyond this, new requests are refused (HTTP 429)
    # Chat responses: split the model's thinking into `reasoning_content` ("qwen3"; None: off,
    # as in vLLM), and turn its tool calls into `tool_calls` ("hermes", Qwen3's format; None:
    # requests with tools are refused).
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    # Sampling defaults for requests that leave a setting out: "auto" takes those the model's
    # generation_config.json recommends (temperature, top_p, top_k, min_p,
    # repetition_penalty; Qwen3's are 0.6 / 0.95 / 20), as vLLM does by default; "vllm":
    # SamplingParams' own (temperature 1, no top_p / top_k), whatever the checkpoint says.
    generation_config: str = "auto"
    # Mixture-of-experts models: each tensor-parallel rank holds whole experts (num_experts
    # must divide by tensor_parallel_size) instead of a slice of every expert, as vLLM's
    # flag of the same name; dense models ignore it.
    enable_expert_parallel: bool = False
    # vLLM's structured_outputs_config.disable_any_whitespace: every JSON constraint (schema,
    # json_object, tool calls) generates compact JSON, with no whitespace between tokens, so a
    # constrained answer cannot spend its max_tokens on whitespace. Per request:
    # structured_outputs.disable_any_whitespace.
    disable_any_whitespace: bool = False
    # A replica whose engine loop made no step for this many seconds while it had requests
    # fails its health check (Serve replaces it; its requests resume on another replica).
    # Longer than the longest step (a whole-batch prefill); never fires while idle.
    engine_stall_timeout_s: float = 120.0
    # vLLM's speculative_config: {method: ngram, num_speculative_tokens: k (1..16),
    # prompt_lookup_min, prompt_lookup_max} proposes tokens by n-gram prompt lookup; the
    # target verifies them in one forward and keeps exactly its own tokens (greedy tokens as
    # without speculation; sampled ones from its distribution). disable_by_batch_size: no
    # speculation in steps with more running sequences. Turns async scheduling off.
    # {model: <draft checkpoint dir or embedded name>, num_speculative_tokens: k}: a small
    # Qwen3 of the target's tokenizer proposes greedily, inside the same workers, sharded like
    # the target, its KV in the same blocks (scheduler/speculative.py, workers/draft_runner.py).
    speculative_config: dict[str, Any] | None = None
    # vLLM's weight quantization method; None: the checkpoint's weights as they are (a
    # checkpoint's own quantization_config is read at load); "fp8": a float checkpoint
    # quantized at load in 128x128 blocks (workers/quantization.py); others are refused.
    quantization: str | None = None
    # vLLM's load_format (workers/config.py LOAD_FORMATS): "auto" reads the model's
    # safetensors; "dummy" fills the weights in place with random values (workers/loader.py),
    # so a benchmark runs a model's shapes from its config.json and tokenizer alone. A
    # speculative draft and LoRA adapters still load their own files.
    load_format: str = "auto"
    # vLLM's hf_overrides: config.json keys set over the checkpoint's, in any spelling
    # transformers reads (workers/hf_config.py); e.g. Qwen3's YaRN to 131,072 tokens:
    # {rope_scaling: {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}}.
    # A key the loader does not read is refused, naming the valid ones.
    hf_overrides: dict[str, Any] | None = None
    # vLLM's kv_cache_dtype (workers/config.py KV_CACHE_DTYPES): "auto", the model's dtype;
    # "fp8" / "fp8_e4m3": K and V stored as float8_e4m3fn over a per-tensor scale (1.0, the
    # checkpoint's k_scale / v_scale, or calculate_kv_scales), twice the blocks of bf16 for the
    # same memory. Read by the Triton and torch kernels (not flash-attn).
    kv_cache_dtype: str = "auto"
    # vLLM's calculate_kv_scales: FP8 KV scales from the first prefill (workers/kv_scales.py);
    # refused with kv_cache_dtype "auto", which has no scales.
    calculate_kv_scales: bool = False
    # LoRA (vLLM's names): requests may name a PEFT adapter (LoRARequest); max_loras adapters
    # sit in device slots at once (a step mixes at most that many), of rank <= max_lora_rank;
    # max_cpu_loras (None: max_loras) loaded adapters are kept in host memory
    # (cluster/engine/lora.py, scheduler/lora.py, workers/lora/).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's runner: "generate" samples tokens; "pooling" returns one vector per input
    # (embeddings, reranker scores: cluster/engine/pooling.py); "auto" picks pooling for a
    # checkpoint with sentence-transformers pooling files or a *ForSequenceClassification
    # architecture, as vLLM does.
    runner: str = "auto"

    def __post_init__(self) -> None:
        _int_at_least(self, "tensor_parallel_size", 1)
        _int_at_least(self, "pipeline_parallel_size", 1)
        if self.pp_layer_partition is not None and not isinstance(self.pp_layer_partition, str):
            raise ValueError("pp_layer_partition must be a string of layer counts per stage "
                             f"such as '3,1'; got {self.pp_layer_partition!r}")
        _int_at_least(self, "max_num_seqs", 1)
        _int_at_least(self, "seed", 0)
        _choice(self, "dtype", _DTYPES)
        _choice(self, "device", _DEVICES)
        _choice(self, "attention_backend", _BACKENDS)
        _choice(self, "executor", _EXECUTORS)
        _choice(self, "kv_transport", (None, "object_store", "rdt"))
        _choice(self, "preemption_mode", (None, "swap", "recompute"))
        _choice(self, "reasoning_parser", (None, *REASONING_PARSERS))
        _choice(self, "tool_call_parser", (None, *TOOL_CALL_PARSERS))
        _choice(self, "generation_config", ("auto", "vllm"))
        _choice(self, "runner", ("auto", "generate", "pooling"))
        check_quantization_arg(self.quantization)
        _choice(self, "load_format", LOAD_FORMATS)
        check_kv_cache_dtype(self.kv_cache_dtype, self.attention_backend)
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError("calculate_kv_scales must be true or false; "
                             f"got {self.calculate_kv_scales!r}")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales needs an FP8 KV cache (its scales); set "
                             "kv_cache_dtype 'fp8' or leave calculate_kv_scales false")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError("hf_overrides must be a mapping of config.json keys to values; "
                             f"got {self.hf_overrides!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("disable_any_whitespace must be true or false; "
                             f"got {self.disable_any_whitespace!r}")
        if not isinstance(self.cpu_exclusive, bool):
            raise ValueError(f"cpu_exclusive must be true or false; got {self.cpu_exclusive!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError("async_scheduling must be true, false or null (auto); "
                             f"got {self.async_scheduling!r}")
        if self.kv_role is not None:
            self._check_kv_role()
        elif self.kv_transport is not None:
            raise ValueError(f"kv_transport {self.kv_transport!r} is how a prefill/decode role's "
                             "KV travels; this engine has no kv_role (colocated): remove it")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError("enable_expert_parallel must be true or false; "
                             f"got {self.enable_expert_parallel!r}")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false; got {self.enable_lora!r}")
        _int_at_least(self, "max_loras", 1)
        _int_at_least(self, "max_lora_rank", 1)
        if self.max_cpu_loras is not None:
            _int_at_least(self, "max_cpu_loras", 1)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                                 f"({self.max_loras}) (as in vLLM: the host cache holds at "
                                 "least as many adapters as the device slots)")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override",
                     "max_waiting_requests", "max_mixed_prefill_tokens"):
            if getattr(self, name) is not None:
                _int_at_least(self, name, 1)
        if (self.max_mixed_prefill_tokens is not None and self.max_num_batched_tokens is not None
                and self.max_mixed_prefill_tokens > self.max_num_batched_tokens):
            raise ValueError(f"max_mixed_prefill_tokens ({self.max_mixed_prefill_tokens}) must be "
                             f"<= max_num_batched_tokens ({self.max_num_batched_tokens})")
        if not (isinstance(self.gpu_memory_utilization, (int, float))
                and 0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError("gpu_memory_utilization must be in (0, 1]; "
                             f"got {self.gpu_memory_utilization!r}")
        if not (isinstance(self.swap_space, (int, float)) and self.swap_space >= 0):
            raise ValueError(f"swap_space must be >= 0 GiB; got {self.swap_space!r}")
        if not (isinstance(self.kv_offloading_size, (int, float))
                and not isinstance(self.kv_offloading_size, bool) and self.kv_offloading_size >= 0):
            raise ValueError("kv_offloading_size must be >= 0 GiB (0 turns the CPU offload tier "
                             f"off); got {self.kv_offloading_size!r}")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size > 0 needs enable_prefix_caching: the CPU offload "
                             "tier finds a block by its prefix hash; enable prefix caching or set "
                             "kv_offloading_size 0")
        if not (isinstance(self.worker_num_cpus, (int, float)) and self.worker_num_cpus > 0):
            raise ValueError(f"worker_num_cpus must be > 0; got {self.worker_num_cpus!r}")
        check_cpu_nice(self.cpu_nice)
        if not (isinstance(self.engine_stall_timeout_s, (int, float))
                and not isinstance(self.engine_stall_timeout_s, bool)
                and self.engine_stall_timeout_s > 0):
            raise ValueError("engine_stall_timeout_s must be > 0 seconds; "
                             f"got {self.engine_stall_timeout_s!r}")
        if self.executor == "inprocess" and self.world_size > 1:
            raise ValueError("executor 'inprocess' runs one worker; use executor 'ray' (or 'auto') "
                             f"for tensor_parallel_size {self.tensor_parallel_size} x "
                             f"pipeline_parallel_size {self.pipeline_parallel_size}")
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("preemption_mode 'swap' needs swap_space > 0 GiB")

    def _check_kv_role(self) -> None:
        if self.kv_role not in ("prefill", "decode"):
            raise ValueError(f"kv_role must be 'prefill', 'decode' or null; got {self.kv_role!r}")
        if not self.enable_prefix_caching:
            raise ValueError(f"kv_role {self.kv_role!r} finds and registers transferred blocks "
                             "by their prefix hashes; set enable_prefix_caching true")
        if self.kv_offloading_size:
            raise ValueError(f"kv_role {self.kv_role!r} with a CPU offload tier is not "
                             "supported (a received block could be offloaded before it is "
                             "written); set kv_offloading_size 0")
        if self.pipeline_parallel_size > 1:
            raise ValueError(f"kv_role {self.kv_role!r} with pipeline_parallel_size "
                             f"{self.pipeline_parallel_size} is not supported (KV moves rank by "
                             "rank between tensor-parallel groups of one stage); set "
                             "pipeline_parallel_size 1 for a PD app's roles")
        t = self.kv_transfer_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ValueError(f"kv_transfer_timeout_s must be a number of seconds > 0; got {t!r}")

    def check_host_memory(self, weights_bytes: int, host_bytes: int) -> None:
        """Raise ValueError when the offload tier, the swap space of every rank and the
        weights (read through host memory) cannot fit this host's memory together."""
        if not self.kv_offloading_size:
            return
        gib = float(1 << 30)
        tp = self.world_size
        need = self.kv_offloading_size + self.swap_space * tp + weights_bytes / gib
        if need > host_bytes / gib:
            raise ValueError(
                f"kv_offloading_size {self.kv_offloading_size} GiB + swap_space "
                f"{self.swap_space} GiB x {tp} rank(s) + weights {weights_bytes / gib:.2f} GiB "
                f"= {need:.2f} GiB exceeds this host's {host_bytes / gib:.2f} GiB of memory; "
                "lower kv_offloading_size or swap_space")

    @property
    def world_size(self) -> int:
        """Worker ranks of one replica: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def uses_ray(self) -> bool:
        return self.executor == "ray" or (self.executor == "auto" and self.world_size > 1)

    def resolve_device(self, *, from_ray: bool) -> str:
        """`device`, with "auto" made "cuda" or "cpu".

        `from_ray`: whether the workers run where Ray places them, so the answer is whether
        the connected Ray cluster has a GPU; otherwise whether this process sees CUDA.
        """
        if self.device != "auto":
            return self.device
        if from_ray:
            import ray

            return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> EngineConfig:
        """Build from a manifest's `args`; unknown keys are an error that lists the valid ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - names)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; valid ones: {sorted(names)}")
        return cls(**args)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _int_at_least(cfg: EngineConfig, name: str, low: int) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")


def _choice(cfg: EngineConfig, name: str, allowed: tuple) -> None:
    value = getattr(cfg, name)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}; got {value!r}")
