"""config.json read as transformers reads it: each spelling transformers writes or accepts
(`num_local_experts` / `num_experts`, `torch_dtype` / `dtype`, `rope_scaling` /
`rope_parameters`, a top-level `rope_theta`), the class defaults, and a Qwen3-MoE checkpoint
whose config transformers 5 re-saved still loading as MoE."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from moe_testlib import MOE_ALL_SPARSE
from transformers import AutoConfig, Qwen3Config, Qwen3MoeConfig

from workers.distributed import TensorParallelGroup
from workers.hf_config import QWEN3_DEFAULTS, QWEN3_MOE_DEFAULTS
from workers.loader import load_model
from workers.model_config import ModelConfig, load_model_config
from workers.qwen3 import Qwen3ForCausalLM
from workers.tiny_model import write_random_qwen3

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=300,
             rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
MOE = dict(SMALL, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
           norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[2])


def _ours_vs_transformers(path: Path) -> tuple[ModelConfig, Any]:
    """Our config and transformers' `AutoConfig.from_pretrained` of the same directory, after
    asserting that every field the loader reads agrees."""
    ours, hf = load_model_config(path), AutoConfig.from_pretrained(path)
    want = {
        "vocab_size": hf.vocab_size, "hidden_size": hf.hidden_size,
        "intermediate_size": hf.intermediate_size, "num_hidden_layers": hf.num_hidden_layers,
        "num_attention_heads": hf.num_attention_heads,
        "num_key_value_heads": hf.num_key_value_heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        "max_position_embeddings": hf.max_position_embeddings, "rms_norm_eps": hf.rms_norm_eps,
        "rope_theta": hf.rope_parameters["rope_theta"],
        "tie_word_embeddings": hf.tie_word_embeddings, "bos_token_id": hf.bos_token_id,
        # No dtype in the file: transformers says None, the loader bfloat16 (the usual one).
        "dtype": str(hf.dtype).removeprefix("torch.") if hf.dtype is not None else "bfloat16",
    }
    if hf.model_type == "qwen3_moe":
        want.update(num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.moe_intermediate_size,
                    norm_topk_prob=hf.norm_topk_prob, decoder_sparse_step=hf.decoder_sparse_step,
                    mlp_only_layers=tuple(hf.mlp_only_layers))
    assert {k: getattr(ours, k) for k in want} == want
    return ours, hf


def _write_json(path: Path, raw: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize(("cls", "defaults"), [(Qwen3Config, QWEN3_DEFAULTS),
                                               (Qwen3MoeConfig, QWEN3_MOE_DEFAULTS)])
def test_defaults_are_the_config_classes(cls: type, defaults: dict) -> None:
    hf = cls()
    assert {k: getattr(hf, k) for k in defaults} == defaults


def test_moe_saved_by_transformers5_names_num_local_experts(tmp_path: Path) -> None:
    Qwen3MoeConfig(**MOE, dtype="float32").save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_local_experts"] == 6
    ours, _ = _ours_vs_transformers(tmp_path)
    assert ours.num_experts == 6 and [ours.is_sparse_layer(i) for i in range(3)] == [
        False, True, False]


def test_hub_spellings_num_experts_torch_dtype_rope_theta(tmp_path: Path) -> None:
    # Qwen3-30B-A3B's config.json as published: num_experts, torch_dtype, rope_theta at the top.
    raw = dict(MOE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
               torch_dtype="bfloat16", rope_theta=1_000_000.0, rope_scaling=None)
    ours, _ = _ours_vs_transformers(_write_json(tmp_path, raw))
    assert (ours.num_experts, ours.dtype, ours.rope_theta) == (6, "bfloat16", 1_000_000.0)


def test_dtype_wins_over_torch_dtype(tmp_path: Path) -> None:
    raw = dict(SMALL, model_type="qwen3", dtype="float16", torch_dtype="bfloat16")
    assert _ours_vs_transformers(_write_json(tmp_path, raw))[0].dtype == "float16"


def test_rope_scaling_spelling_of_rope_parameters(tmp_path: Path) -> None:
    raw = dict(SMALL, model_type="qwen3",
               rope_scaling={"type": "default", "rope_theta": 2500.0})
    assert _ours_vs_transformers(_write_json(tmp_path, raw))[0].rope_theta == 2500.0


def test_keys_left_out_take_the_class_defaults(tmp_path: Path) -> None:
    # Dense Qwen3Config's head_dim default is 128 (not hidden // heads); Qwen3MoeConfig has no
    # head_dim, so the MoE model takes hidden // heads; both default rope_theta to 10000.
    dense = {k: v for k, v in SMALL.items() if k != "max_position_embeddings"}
    ours, _ = _ours_vs_transformers(_write_json(tmp_path / "d", dict(dense, model_type="qwen3")))
    assert (ours.head_dim, ours.rope_theta, ours.max_position_embeddings) == (128, 10000.0, 32768)
    moe = {k: v for k, v in MOE.items() if k not in ("num_experts", "num_experts_per_tok")}
    ours, _ = _ours_vs_transformers(_write_json(tmp_path / "m", dict(moe, model_type="qwen3_moe")))
    assert (ours.head_dim, ours.num_experts, ours.num_experts_per_tok) == (8, 128, 8)


def test_two_spellings_with_different_values_are_refused(tmp_path: Path) -> None:
    raw = dict(MOE, model_type="qwen3_moe", num_local_experts=4)
    with pytest.raises(ValueError, match=r"num_local_experts=4 and num_experts=6.*keep one"):
        load_model_config(_write_json(tmp_path, raw))


def test_resaved_moe_checkpoint_loads_its_experts(tmp_path: Path) -> None:
    # The reported bug: transformers 5 re-saves a hub MoE config with num_local_experts, and
    # the loader read it as dense, failing on the first expert tensor.
    path = write_random_qwen3(tmp_path / "m", MOE_ALL_SPARSE, seed=3)
    AutoConfig.from_pretrained(path).save_pretrained(path)
    assert "num_local_experts" in json.loads((path / "config.json").read_text())
    cfg = load_model_config(path)
    model = Qwen3ForCausalLM(cfg, TensorParallelGroup(0, 1, None), torch.float32, "torch")
    load_model(model, path)
    w2 = dict(model.named_parameters())["model.layers.1.mlp.w2_weight"]
    assert w2.shape == (8, 64, 32) and bool(w2.abs().sum() > 0)
