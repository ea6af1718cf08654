"""config.json parsing: both RoPE spellings, EOS ids, and errors a user can act on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.config import WorkerConfig
from workers.model_config import load_model_config
from workers.tiny_model import qwen3_config_dict


def _write(path: Path, cfg: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


BASE = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 5000.0,
        "tie_word_embeddings": True, "dtype": "bfloat16"}


def test_tiny_model_config(tiny_dir: str) -> None:
    cfg = load_model_config(tiny_dir)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == \
        (128, 4, 2, 32)
    assert cfg.rope_theta == 1e6 and cfg.tie_word_embeddings and cfg.dtype == "float32"
    assert cfg.eos_token_ids == (151645, 151643)  # generation_config.json lists both
    assert cfg.kv_block_bytes(16, 2, 4) == 2 * 4 * 16 * 1 * 32 * 4


def test_transformers5_rope_parameters(tmp_path: Path) -> None:
    cfg = load_model_config(_write(tmp_path, qwen3_config_dict(BASE)))
    assert cfg.rope_theta == 5000.0 and cfg.dtype == "bfloat16" and cfg.eos_token_ids == (151645,)


def test_legacy_rope_theta_and_torch_dtype(tmp_path: Path) -> None:
    raw = {k: v for k, v in qwen3_config_dict(BASE).items() if k not in ("rope_parameters", "dtype")}
    raw.update(rope_theta=12345.0, torch_dtype="float16", rope_scaling=None, eos_token_id=[7, 8])
    cfg = load_model_config(_write(tmp_path, raw))
    assert cfg.rope_theta == 12345.0 and cfg.dtype == "float16" and cfg.eos_token_ids == (7, 8)


def test_missing_config_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        load_model_config(tmp_path)


def test_wrong_architecture_is_a_value_error(tmp_path: Path) -> None:
    raw = dict(qwen3_config_dict(BASE), architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        load_model_config(_write(tmp_path, raw))


def test_unsupported_rope_type_is_a_value_error(tmp_path: Path) -> None:
    raw = dict(qwen3_config_dict(BASE), rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                         "rope_theta": 1.0})
    with pytest.raises(ValueError, match=r"rope_type 'dynamic'.*supported: \['default', 'yarn'\]"):
        load_model_config(_write(tmp_path, raw))


@pytest.mark.parametrize(("tp", "ok"), [(1, True), (2, True), (4, True), (3, False), (8, False)])
def test_tensor_parallel_size_must_split_heads(tmp_path: Path, tp: int, ok: bool) -> None:
    path = _write(tmp_path, qwen3_config_dict(BASE))
    if ok:
        assert load_model_config(path, tp).num_kv_heads_per_rank(tp) == max(1, 2 // tp)
    else:
        with pytest.raises(ValueError, match=f"tensor_parallel_size={tp}"):
            load_model_config(path, tp)


@pytest.mark.parametrize("bad", [dict(dtype="int8"), dict(device="tpu"), dict(rank=2),
                                 dict(tensor_parallel_size=2), dict(block_size=0),
                                 dict(gpu_memory_utilization=1.5), dict(swap_space=-1),
                                 dict(attention_backend="xformers")])
def test_worker_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        WorkerConfig(model="m", **bad)
