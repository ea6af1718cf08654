"""A Qwen3 checkpoint's `config.json` (+ `generation_config.json`) as a small dataclass.

Dense Qwen3 (`Qwen3ForCausalLM`) and mixture-of-experts Qwen3 (`Qwen3MoeForCausalLM`: the
router and experts' sizes, and `decoder_sparse_step` / `mlp_only_layers`, which pick the
layers whose MLP is sparse, as transformers does). The file is read as transformers reads it
(aliases, legacy spellings and class defaults: workers/hf_config.py); this module checks what
the worker implements. The engine uses it too (max length, EOS ids, vocab size), so it
imports nothing heavier than the standard library. `check_weights_fit` says, before
any allocation, whether a rank's weights fit its device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.hf_config import is_moe, read_hf_config
from workers.quantization import Fp8Config, quantization_config

_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_MODEL_TYPES = ("qwen3", "qwen3_moe")
_CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")
_ROPE_TYPES = ("default", "yarn")


@dataclass(slots=True, frozen=True)
class YarnScaling:
    """YaRN's rope parameters (transformers' names and defaults); the rotary table is
    `kernels.compute_cos_sin_cache(..., yarn=asdict(this))`."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """The fields of a Qwen3 config the serving system reads; `head_dim` is always explicit."""

    model: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    dtype: str  # the checkpoint's dtype: float32 | bfloat16 | float16
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Mixture of experts (0 experts: dense). Layer i is sparse when i is not in
    # mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (transformers' rule).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    yarn: YarnScaling | None = None  # None: plain RoPE
    quantization: Fp8Config | None = None  # the linear layers' weights (None: as loaded)

    @property
    def max_context_len(self) -> int:
        """The longest sequence the positions allow: factor x original context with YaRN (as
        vLLM derives it), else max_position_embeddings."""
        if self.yarn is None:
            return self.max_position_embeddings
        return int(self.yarn.factor * self.yarn.original_max_position_embeddings)

    def check_max_model_len(self, max_model_len: int) -> None:
        """ValueError naming the limit and where it comes from when `max_model_len` is past it."""
        if max_model_len <= self.max_context_len:
            return
        if self.yarn is None:
            raise ValueError(f"max_model_len {max_model_len} exceeds {self.model}'s "
                             f"max_position_embeddings {self.max_position_embeddings}; lower "
                             "max_model_len, or extend the context with YaRN (hf_overrides: "
                             "{rope_scaling: {rope_type: yarn, factor, "
                             "original_max_position_embeddings}})")
        raise ValueError(f"max_model_len {max_model_len} exceeds what {self.model}'s YaRN allows: "
                         f"factor {self.yarn.factor} x original_max_position_embeddings "
                         f"{self.yarn.original_max_position_embeddings} = {self.max_context_len}; "
                         "lower max_model_len or raise the factor")

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the experts block (else the dense Qwen3 MLP)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def weight_bytes_per_rank(self, tensor_parallel_size: int, itemsize: int,
                              stage: Any = None) -> int:
        """Bytes of one rank's weights (embedding and head split over the ranks, norms
        replicated, experts split whether by TP or EP: each rank holds 1/tp of them); an FP8
        checkpoint's linear layers and experts take one byte a weight plus a float32 scale per
        block, the rest `itemsize`. `quantization: fp8` over a float checkpoint counts the float
        bytes: loading holds them all before it quantizes. `stage` (workers/pipeline.py's
        PipelineStage; None: the whole model): its layers, the embedding on the first, the
        final norm and LM head on the last (its own copy of a tied table at pp > 1)."""
        tp, h = tensor_parallel_size, self.hidden_size
        nq, d = self.num_attention_heads, self.head_dim
        kv_per_rank = self.num_kv_heads_per_rank(tp)
        layers = range(self.num_hidden_layers)
        first = last = True
        if stage is not None and stage.size > 1:
            layers = range(stage.start_layer, stage.end_layer)
            first, last = stage.is_first, stage.is_last
        # one rank's quantizable matrices: (count, rows, columns); merged ones as one
        matrices: list[tuple[int, int, int]] = []
        other = 0
        for i in layers:
            matrices += [(1, (nq // tp + 2 * kv_per_rank) * d, h), (1, h, nq // tp * d)]
            if self.is_sparse_layer(i):
                inter = self.moe_intermediate_size // tp
                matrices += [(self.num_experts, 2 * inter, h), (self.num_experts, h, inter)]
                other += self.num_experts * h
            else:
                inter = self.intermediate_size // tp
                matrices += [(1, 2 * inter, h), (1, h, inter)]
            other += 2 * d + 2 * h
        vocab = -(-self.vocab_size // tp) * h
        tables = first + last - (first and last and self.tie_word_embeddings)
        other += vocab * tables + h * last
        linear = sum(n * rows * cols for n, rows, cols in matrices)
        if self.quantization is None or not self.quantization.from_checkpoint:
            return (linear + other) * itemsize
        bn, bk = self.quantization.weight_block_size  # a partial last block has its scale
        scales = sum(n * -(-rows // bn) * -(-cols // bk) for n, rows, cols in matrices)
        return linear + scales * 4 + other * itemsize

    def num_kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        """KV heads one rank holds: a shard, or one replicated head when tp > num_kv_heads."""
        return max(1, self.num_key_value_heads // tensor_parallel_size)

    def kv_block_bytes(self, block_size: int, tensor_parallel_size: int, itemsize: int,
                       num_layers: int | None = None) -> int:
        """Bytes of one KV block on one rank, K and V of every layer (of `num_layers`: a
        pipeline stage's)."""
        layers = self.num_hidden_layers if num_layers is None else num_layers
        return (2 * layers * block_size
                * self.num_kv_heads_per_rank(tensor_parallel_size) * self.head_dim * itemsize)

    def verify_tensor_parallel_size(self, tensor_parallel_size: int) -> None:
        """Raise ValueError unless `tensor_parallel_size` splits the heads evenly."""
        tp = tensor_parallel_size
        nq, nkv = self.num_attention_heads, self.num_key_value_heads
        if nq % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads={nq} "
                             f"of {self.model}; use a divisor of {nq}")
        if (tp <= nkv and nkv % tp) or (tp > nkv and tp % nkv):
            raise ValueError(f"tensor_parallel_size={tp} must divide num_key_value_heads={nkv} "
                             f"(or be a multiple of it) for {self.model}")


def load_model_config(model: str | Path, tensor_parallel_size: int = 1,
                      hf_overrides: dict[str, Any] | None = None,
                      quantization: str | None = None,
                      load_format: str = "auto") -> ModelConfig:
    """Read `model`/config.json as transformers does (workers/hf_config.py), with vLLM's
    `hf_overrides` over it and the `quantization` engine argument (workers/quantization.py;
    `load_format` "dummy": no weights on disk to check a declared quantization against);
    ValueError for a missing file, another architecture, a setting this worker does not
    implement, a bad tp size."""
    path = Path(model)
    raw = read_hf_config(path, hf_overrides)
    archs = raw.get("architectures") or []
    if not any(a in _ARCHITECTURES for a in archs) and raw.get("model_type") not in _MODEL_TYPES:
        raise ValueError(f"{path} is a {archs or raw.get('model_type')!r} checkpoint; "
                         f"only {list(_ARCHITECTURES)} (model_type {list(_MODEL_TYPES)}) "
                         "is supported")
    if raw["attention_bias"]:
        raise ValueError(f"{path} sets attention_bias=true; Qwen3 has no attention bias and "
                         "this worker does not implement one")
    if raw["use_sliding_window"]:
        raise ValueError(f"{path} sets use_sliding_window=true; sliding-window attention is "
                         "not supported")
    if raw["hidden_act"] != "silu":
        raise ValueError(f"{path} uses hidden_act={raw['hidden_act']!r}; only 'silu' is supported")
    dtype = str(raw.get("dtype") or "bfloat16")
    if dtype not in _CHECKPOINT_DTYPES:
        raise ValueError(f"{path} has dtype {dtype!r}; expected one of {_CHECKPOINT_DTYPES}")
    rope = raw["rope_parameters"]
    cfg = ModelConfig(
        model=str(path),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=int(raw["num_attention_heads"]),
        num_key_value_heads=int(raw["num_key_value_heads"]),
        head_dim=int(raw["head_dim"]),
        max_position_embeddings=int(raw["max_position_embeddings"]),
        rms_norm_eps=float(raw["rms_norm_eps"]),
        rope_theta=float(rope["rope_theta"]),
        tie_word_embeddings=bool(raw["tie_word_embeddings"]),
        dtype=dtype,
        bos_token_id=raw["bos_token_id"],
        eos_token_ids=_eos_token_ids(raw, path),
        yarn=_yarn(rope, path),
        quantization=quantization_config(raw, path, quantization, load_format),
        **_moe_fields(raw, path),
    )
    cfg.verify_tensor_parallel_size(tensor_parallel_size)
    return cfg


def _moe_fields(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """The mixture-of-experts keys of a qwen3_moe config; {} for a dense one."""
    if not is_moe(raw):
        return {}
    fields = {
        "num_experts": int(raw["num_experts"]),
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw["moe_intermediate_size"]),
        "norm_topk_prob": bool(raw["norm_topk_prob"]),
        "decoder_sparse_step": int(raw["decoder_sparse_step"]),
        "mlp_only_layers": tuple(int(i) for i in raw["mlp_only_layers"]),
    }
    if fields["num_experts"] < 1:
        raise ValueError(f"{path}: a qwen3_moe config needs num_experts (num_local_experts) "
                         f">= 1; got {fields['num_experts']}")
    if not 1 <= fields["num_experts_per_tok"] <= fields["num_experts"]:
        raise ValueError(f"{path}: num_experts_per_tok={fields['num_experts_per_tok']} must be in "
                         f"[1, num_experts={fields['num_experts']}]")
    if fields["decoder_sparse_step"] < 1:
        raise ValueError(f"{path}: decoder_sparse_step must be >= 1; got "
                         f"{fields['decoder_sparse_step']}")
    return fields


def _yarn(rope: dict[str, Any], path: Path) -> YarnScaling | None:
    """The YaRN parameters of standardized rope parameters; None for plain RoPE."""
    rope_type = rope["rope_type"]
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ValueError(f"{path} uses rope_type {rope_type!r} (rope_parameters / rope_scaling); "
                         f"supported: {list(_ROPE_TYPES)}")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor")
    if factor is None:
        raise ValueError(f"{path}: rope_type 'yarn' needs rope_parameters.factor (Qwen3's "
                         "documented setting: factor 4.0, original_max_position_embeddings "
                         "32768)")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
        raise ValueError(f"{path}: YaRN's factor must be a number >= 1; got {factor!r}")
    if original < 1:
        raise ValueError(f"{path}: YaRN's original_max_position_embeddings must be >= 1; "
                         f"got {original}")
    optional = ("attention_factor", "mscale", "mscale_all_dim")
    return YarnScaling(
        factor=float(factor), original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
        truncate=bool(rope.get("truncate", True)),
        **{k: float(rope[k]) for k in optional if rope.get(k) is not None})


def _eos_token_ids(raw: dict[str, Any], path: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (it lists all of them), else config.json."""
    eos: Any = _generation_config(path).get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        return ()
    ids = [eos] if isinstance(eos, int) else list(eos)
    return tuple(dict.fromkeys(int(i) for i in ids))


# generation_config.json keys that become sampling defaults (vLLM's `generation_config: auto`).
GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_defaults(path: str | Path) -> dict[str, float | int]:
    """The sampling settings a checkpoint's generation_config.json recommends (those of
    GENERATION_SAMPLING_KEYS it sets), e.g. Qwen3's temperature 0.6, top_k 20, top_p 0.95;
    empty without the file. Values keep their JSON type (top_k an int)."""
    gen = _generation_config(Path(path))
    out: dict[str, float | int] = {}
    for key in GENERATION_SAMPLING_KEYS:
        value = gen.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[key] = int(value) if key == "top_k" else float(value)
    return out


def _generation_config(path: Path) -> dict[str, Any]:
    """The checkpoint's generation_config.json, or {} without one."""
    gen_file = path / "generation_config.json"
    return json.loads(gen_file.read_text()) if gen_file.is_file() else {}


def check_weights_fit(mc: ModelConfig, tensor_parallel_size: int, itemsize: int,
                      device_bytes: int, gpu_memory_utilization: float,
                      draft: ModelConfig | None = None, stage: Any = None) -> None:
    """ValueError, before any allocation, when one rank's weights (the target's, of its
    pipeline `stage` when given, and a speculative draft's shard beside them) exceed its share
    of the device."""
    need = mc.weight_bytes_per_rank(tensor_parallel_size, itemsize, stage)
    if draft is not None:
        need += draft.weight_bytes_per_rank(tensor_parallel_size, itemsize)
    budget = int(device_bytes * gpu_memory_utilization)
    if need > budget:
        gib = 1024 ** 3
        with_draft = "" if draft is None else f" with the draft {draft.model}"
        raise ValueError(
            f"{mc.model}{with_draft}: one rank's weights take {need / gib:.1f} GiB at "
            f"tensor_parallel_size={tensor_parallel_size}, more than gpu_memory_utilization="
            f"{gpu_memory_utilization} of the device's {device_bytes / gib:.1f} GiB "
            f"({budget / gib:.1f} GiB); use more tensor-parallel ranks")
