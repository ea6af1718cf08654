"""A Qwen3 checkpoint's config.json read the way transformers reads it, as a plain dict.

transformers' config classes (`Qwen3Config`, `Qwen3MoeConfig`) accept several spellings of
one attribute and fill what a file leaves out with class defaults; a checkpoint saved by one
transformers version and read by another relies on both. `read_hf_config` applies the same
rules with the standard library only (the engine reads configs before it imports torch):

- attribute aliases (a class's `attribute_map`): Qwen3-MoE's `num_local_experts`, which
  transformers 5 writes, is `num_experts`, which the hub's configs say;
- `torch_dtype` is `dtype` (`dtype` wins when both are set);
- `rope_scaling` is `rope_parameters` (`rope_scaling` wins when both are set, as in
  transformers' `convert_rope_params_to_dict`); a top-level `rope_theta` and the legacy
  `type` move into it; yarn's `original_max_position_embeddings` defaults to a top-level
  one, else to `max_position_embeddings` (`standardize_rope_params`);
- every key the loader reads that the file leaves out takes the class's default
  (`QWEN3_DEFAULTS`, `QWEN3_MOE_DEFAULTS`: tests compare them with transformers' classes).

vLLM's `hf_overrides` (a dict of config keys, any spelling) go over the file's keys first; a
dict value is merged into the file's dict of the same key, so `{"rope_scaling": {"rope_type":
"yarn", ...}}` keeps the checkpoint's `rope_theta`.

Invariant: the returned dict names each attribute once, by its canonical name (the config
classes' field names), and `rope_parameters` is a standardized flat dict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MOE_ARCHITECTURE = "Qwen3MoeForCausalLM"
MOE_MODEL_TYPE = "qwen3_moe"

# transformers' PreTrainedConfig.default_theta.
DEFAULT_ROPE_THETA = 10000.0

# Qwen3Config's defaults for the keys the loader reads (head_dim 128 is Qwen3Config's own).
QWEN3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "use_sliding_window": False, "bos_token_id": None, "eos_token_id": None,
}
# Qwen3MoeConfig's; it has no head_dim field: the model takes hidden_size // heads.
QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
    "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
    "bos_token_id": None, "eos_token_id": None, "decoder_sparse_step": 1,
    "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
    "norm_topk_prob": False, "mlp_only_layers": [],
}
# attribute_map of each class: the alias a file may use -> the attribute's canonical name.
_ATTRIBUTE_MAP: dict[str, dict[str, str]] = {
    "qwen3": {},
    MOE_MODEL_TYPE: {"num_local_experts": "num_experts"},
}
# PreTrainedConfig's spellings, for every model type.
_COMMON_ALIASES = {"torch_dtype": "dtype"}
# Keys an hf_override may set: those read here (any spelling) and the checkpoint's identity.
_READ_KEYS = ({"dtype", "rope_parameters", "rope_theta", "original_max_position_embeddings",
               "quantization_config", "architectures", "model_type", "head_dim",
               # pooling (cluster/engine/pooling.py): vLLM's reranker and Matryoshka keys
               "classifier_from_token", "is_original_qwen3_reranker", "is_matryoshka",
               "matryoshka_dimensions"}
              | set(QWEN3_MOE_DEFAULTS) | set(QWEN3_DEFAULTS))


def is_moe(raw: dict[str, Any]) -> bool:
    """Whether a config.json is Qwen3-MoE's (by model_type or architecture)."""
    return raw.get("model_type") == MOE_MODEL_TYPE or MOE_ARCHITECTURE in (
        raw.get("architectures") or [])


def read_hf_config(path: Path, hf_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """`path`/config.json with `hf_overrides` over it, aliases resolved, rope parameters
    standardized and the class defaults filled in; ValueError for a missing or invalid file
    or an override of a key this loader does not read."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"no config.json in {str(path)!r}; pass a Hugging Face checkpoint "
                         "directory (or 'qwen3-tiny')")
    try:
        raw: dict[str, Any] = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} must hold a JSON object; got {type(raw).__name__}")
    overrides = _check_overrides(hf_overrides)
    moe = is_moe({**raw, **overrides})
    aliases = {**_COMMON_ALIASES, **_ATTRIBUTE_MAP[MOE_MODEL_TYPE if moe else "qwen3"]}
    cfg = _canonical(raw, aliases, str(config_file))
    for key, value in _canonical(overrides, aliases, "hf_overrides").items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    defaults = QWEN3_MOE_DEFAULTS if moe else QWEN3_DEFAULTS
    for key, value in defaults.items():
        if cfg.get(key) is None:
            cfg[key] = value
    if cfg.get("head_dim") is None:
        cfg["head_dim"] = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    if cfg.get("num_key_value_heads") is None:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg["rope_parameters"] = _standard_rope(cfg)
    return cfg


def _check_overrides(hf_overrides: dict[str, Any] | None) -> dict[str, Any]:
    if hf_overrides is None:
        return {}
    if not isinstance(hf_overrides, dict):
        raise ValueError("hf_overrides must be a mapping of config.json keys to values; "
                         f"got {type(hf_overrides).__name__}")
    allowed = _READ_KEYS | set(_COMMON_ALIASES) | {"rope_scaling"} | {
        alias for table in _ATTRIBUTE_MAP.values() for alias in table}
    unknown = sorted(set(hf_overrides) - allowed)
    if unknown:
        raise ValueError(f"hf_overrides sets {unknown}, which this loader does not read; "
                         f"valid keys: {sorted(allowed)}")
    return dict(hf_overrides)


def _canonical(raw: dict[str, Any], aliases: dict[str, str], where: str) -> dict[str, Any]:
    """`raw` with each alias renamed to its attribute; rope_scaling folded into rope_parameters."""
    out = dict(raw)
    for alias, name in aliases.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if out.get(name) is None:
            out[name] = value
        elif alias != "torch_dtype" and value is not None and value != out[name]:
            raise ValueError(f"{where} sets both {alias}={value!r} and {name}={out[name]!r} "
                             "(two spellings of one setting); keep one")
    scaling = out.pop("rope_scaling", None)
    if scaling:
        out["rope_parameters"] = scaling
    return out


def _standard_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers' `standardize_rope_params` for a flat (not per-layer-type) dict."""
    params = dict(cfg.get("rope_parameters") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", DEFAULT_ROPE_THETA))
    params.setdefault("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    if params["rope_type"] == "yarn":
        if cfg.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return params
