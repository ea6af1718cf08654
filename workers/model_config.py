"""A Qwen3 checkpoint's `config.json` (+ `generation_config.json`) as a small dataclass.

Reads transformers-5 configs (`rope_parameters`) and legacy ones (`rope_theta`,
`rope_scaling`, `torch_dtype`). The engine uses it too (max length, EOS ids, vocab size),
so it imports nothing heavier than the standard library.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ARCHITECTURES = ("Qwen3ForCausalLM",)
_CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


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

    def num_kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        """KV heads one rank holds: a shard, or one replicated head when tp > num_kv_heads."""
        return max(1, self.num_key_value_heads // tensor_parallel_size)

    def kv_block_bytes(self, block_size: int, tensor_parallel_size: int, itemsize: int) -> int:
        """Bytes of one KV block on one rank, K and V of every layer."""
        return (2 * self.num_hidden_layers * block_size
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


def load_model_config(model: str | Path, tensor_parallel_size: int = 1) -> ModelConfig:
    """Read `model`/config.json; ValueError for a missing file, another architecture, a bad tp size."""
    path = Path(model)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"no config.json in {str(path)!r}; pass a Hugging Face checkpoint "
                         "directory (or 'qwen3-tiny')")
    try:
        raw: dict[str, Any] = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from e
    archs = raw.get("architectures") or []
    if not any(a in _ARCHITECTURES for a in archs) and raw.get("model_type") != "qwen3":
        raise ValueError(f"{path} is a {archs or raw.get('model_type')!r} checkpoint; "
                         f"only {list(_ARCHITECTURES)} (model_type 'qwen3') is supported")
    if raw.get("attention_bias"):
        raise ValueError(f"{path} sets attention_bias=true; Qwen3 has no attention bias and "
                         "this worker does not implement one")
    if raw.get("use_sliding_window"):
        raise ValueError(f"{path} sets use_sliding_window=true; sliding-window attention is "
                         "not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path} uses hidden_act={raw['hidden_act']!r}; only 'silu' is supported")
    nq = int(raw["num_attention_heads"])
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16")
    if dtype not in _CHECKPOINT_DTYPES:
        raise ValueError(f"{path} has dtype {dtype!r}; expected one of {_CHECKPOINT_DTYPES}")
    cfg = ModelConfig(
        model=str(path),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=nq,
        num_key_value_heads=int(raw.get("num_key_value_heads") or nq),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // nq),
        max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(raw, path),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype=dtype,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_token_ids(raw, path),
    )
    cfg.verify_tensor_parallel_size(tensor_parallel_size)
    return cfg


def _rope_theta(raw: dict[str, Any], path: Path) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{path} uses rope_type {rope_type!r}; only 'default' RoPE is supported")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{path}/config.json has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


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
