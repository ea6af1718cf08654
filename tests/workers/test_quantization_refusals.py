"""Quantized checkpoints and the `quantization` engine argument are refused at start, naming
the method: Qwen's FP8 format (FP8 weights are not supported yet), any other method, and a
`quantization_config` declared over weights that are not quantized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from workers_testlib import SINGLE_KV_CONFIG

from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine
from workers.model_config import load_model_config
from workers.tiny_model import write_random_qwen3

QWEN_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}


def _with_config(path: Path, **extra: object) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **extra}))
    return path


def _to_qwen_fp8(path: Path) -> Path:
    """Quantize every linear weight the way Qwen's FP8 checkpoints store it: e4m3 weights and
    one float32 `weight_scale_inv` per 128x128 block."""
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors[name]
        scale = w.abs().amax().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        tensors[name] = (w / scale).to(torch.float8_e4m3fn)
        blocks = (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        tensors[name + "_scale_inv"] = torch.full(blocks, float(scale))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return _with_config(path, quantization_config=QWEN_FP8)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_random_qwen3(tmp_path / "m", SINGLE_KV_CONFIG, seed=2)


def test_qwen_fp8_checkpoint_is_refused_by_name(ckpt: Path) -> None:
    _to_qwen_fp8(ckpt)
    with pytest.raises(ValueError, match=r"FP8 checkpoint \(quantization_config.quant_method "
                                         r"'fp8', its 'model.layers.0.mlp.down_proj.weight' "
                                         r"is F8_E4M3\): FP8 weights are not "
                                         r"supported yet") as e:
        load_model_config(ckpt)
    assert "no parameter for" not in str(e.value)


def test_engine_start_refuses_fp8_checkpoint(ckpt: Path) -> None:
    _to_qwen_fp8(ckpt)
    with pytest.raises(ValueError, match="FP8 weights are not supported yet"):
        LLMEngine(EngineConfig(model=str(ckpt), device="cpu"))


def test_other_quantization_method_is_refused(ckpt: Path) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.qweight"] = torch.zeros(4, 8, dtype=torch.int32)
    save_file(tensors, ckpt / "model.safetensors")
    _with_config(ckpt, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match=r"quant_method 'gptq', which is not supported; "
                                         r"supported methods: none yet"):
        load_model_config(ckpt)


def test_quantization_config_over_unquantized_weights_is_refused(ckpt: Path) -> None:
    _with_config(ckpt, quantization_config=QWEN_FP8)
    with pytest.raises(ValueError, match=r"declares quantization_config \(quant_method 'fp8'\) "
                                         r"but its weights are not quantized.*remove "
                                         r"quantization_config"):
        load_model_config(ckpt)


def test_malformed_quantization_config_is_refused(ckpt: Path) -> None:
    _with_config(ckpt, quantization_config="fp8")
    with pytest.raises(ValueError, match="quantization_config must be an object; got 'fp8'"):
        load_model_config(ckpt)


@pytest.mark.parametrize(("value", "message"), [
    ("fp8", r"quantization 'fp8': FP8 weights are not supported yet.*leave quantization unset"),
    ("awq", r"quantization must be null \(no quantization\); supported methods: none yet; "
            r"got 'awq'"),
])
def test_quantization_engine_arg_is_refused(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(quantization=value)
    with pytest.raises(ValueError, match=message):  # a manifest's args
        EngineConfig.from_dict({"model": "qwen3-tiny", "quantization": value})


def test_no_quantization_is_the_default() -> None:
    assert EngineConfig().quantization is None and EngineConfig(quantization=None)
