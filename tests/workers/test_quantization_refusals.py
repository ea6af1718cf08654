"""Quantized checkpoints and the `quantization` engine argument this worker cannot serve are
refused at start, naming the method or the key: any method but block-scaled FP8, FP8 variants
(another fmt, static activations, per-tensor scales), `quantization: fp8` over another method,
a TP size or dims that split a scale block, and a `quantization_config` declared over weights
that are not quantized."""

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
from workers.quantization import Fp8Config
from workers.tiny_model import write_random_qwen3

QWEN_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}


def _with_config(path: Path, **extra: object) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **extra}))
    return path


def _to_qwen_fp8(path: Path) -> Path:
    """Every linear weight as e4m3 with one float32 `weight_scale_inv` per 128x128 block
    (Qwen's FP8 layout; the scale values do not matter to these refusals)."""
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors[name]
        tensors[name] = w.to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.ones(-(-w.shape[0] // 128), -(-w.shape[1] // 128))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return _with_config(path, quantization_config=QWEN_FP8)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_random_qwen3(tmp_path / "m", SINGLE_KV_CONFIG, seed=2)


def test_qwen_fp8_checkpoint_is_read_as_block_fp8(ckpt: Path) -> None:
    _to_qwen_fp8(ckpt)
    assert load_model_config(ckpt).quantization == Fp8Config((128, 128), from_checkpoint=True)
    assert load_model_config(ckpt, quantization="fp8").quantization is not None
    # Qwen's MoE checkpoints keep their routers and lm_head in BF16, as this worker does
    _with_config(ckpt, quantization_config={
        **QWEN_FP8, "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]})
    assert load_model_config(ckpt).quantization is not None


@pytest.mark.parametrize(("key", "value", "message"), [
    ("fmt", "e5m2", r"fmt 'e5m2' is not supported; only 'e4m3'"),
    ("activation_scheme", "static", r"activation_scheme 'static' is not supported"),
    ("weight_block_size", None, r"weight_block_size must be two positive integers.*"
                                r"per-tensor FP8 is not supported\); got None"),
    ("modules_to_not_convert", ["lm_head", "model.layers.0.mlp.gate",
                                "model.layers.1.self_attn.o_proj"],
     r"modules_to_not_convert keeps \['model.layers.1.self_attn.o_proj'\] unquantized"),
])
def test_fp8_variants_are_refused_by_key(ckpt: Path, key: str, value: object,
                                         message: str) -> None:
    _to_qwen_fp8(ckpt)
    _with_config(ckpt, quantization_config={**QWEN_FP8, key: value})
    with pytest.raises(ValueError, match=message):
        load_model_config(ckpt)


def test_engine_start_refuses_fp8_blocks_the_dims_split(ckpt: Path) -> None:
    """The tiny dims (64, 96) are not whole 128x128 blocks: refused at start, naming them."""
    _to_qwen_fp8(ckpt)
    with pytest.raises(ValueError, match=r"one rank's QKVParallelLinear part 0 is \[64, 64\] at "
                                         r"tensor_parallel_size=1, which splits a scale block"):
        LLMEngine(EngineConfig(model=str(ckpt), device="cpu"))


def test_other_quantization_method_is_refused(ckpt: Path) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.qweight"] = torch.zeros(4, 8, dtype=torch.int32)
    save_file(tensors, ckpt / "model.safetensors")
    _with_config(ckpt, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match=r"quant_method 'gptq', which is not supported; "
                                         r"supported methods: fp8"):
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


def test_unknown_quantization_engine_arg_is_refused() -> None:
    message = (r"quantization must be null \(the checkpoint's weights as they are\) or one of: "
               r"fp8; got 'awq'")
    with pytest.raises(ValueError, match=message):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match=message):  # a manifest's args
        EngineConfig.from_dict({"model": "qwen3-tiny", "quantization": "awq"})
    assert EngineConfig(quantization="fp8").quantization == "fp8"


def test_quantization_fp8_over_another_method_is_refused(ckpt: Path) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.qweight"] = torch.zeros(4, 8, dtype=torch.int32)
    save_file(tensors, ckpt / "model.safetensors")
    _with_config(ckpt, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method 'gptq', which is not supported"):
        load_model_config(ckpt, quantization="fp8")


def test_no_quantization_is_the_default() -> None:
    assert EngineConfig().quantization is None and EngineConfig(quantization=None)
