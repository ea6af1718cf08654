"""FP8 test checkpoints: random Qwen3 models (dense and MoE) whose quantized dims are multiples
of 128, written in Qwen's FP8 format by the tests (e4m3 weights, a float32 `weight_scale_inv`
per 128x128 block, Qwen's `quantization_config`), and the same weights dequantized into a
float checkpoint: the transformers oracle's model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from kernels.fp8_reference import (
    dequantize_weight_blocks,
    fake_quantize_act_groups,
    quantize_weight_blocks,
)

_LINEAR = F.linear

QWEN_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}
BLOCK = (128, 128)

# Every per-rank slice at tp 1 and 2 is whole 128x128 blocks (q 512, k/v 256, MLP 256).
FP8_DENSE_CONFIG: dict[str, Any] = {
    "vocab_size": 1003, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
FP8_MOE_CONFIG: dict[str, Any] = {
    **FP8_DENSE_CONFIG, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 256, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def write_qwen_fp8(src: str | Path, fp8_dir: Path, dequant_dir: Path) -> None:
    """`src`'s projections quantized in Qwen's FP8 format into `fp8_dir`, and the dequantized
    weights (what the FP8 checkpoint means) as a float checkpoint into `dequant_dir`."""
    tensors = load_file(Path(src) / "model.safetensors")
    fp8, dequant = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        q, scale = quantize_weight_blocks(tensors[name], BLOCK)
        fp8[name], fp8[name + "_scale_inv"] = q, scale
        dequant[name] = dequantize_weight_blocks(q, scale, BLOCK)
    for out, weights, extra in ((fp8_dir, fp8, {"quantization_config": QWEN_FP8}),
                                (dequant_dir, dequant, {})):
        shutil.copytree(src, out)
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, **extra}))


def fake_quantize_activations(model: nn.Module) -> None:
    """Make a transformers model W8A8 as the FP8 layers are: every attention and dense-MLP
    projection's input quantized per token and 128-group and dequantized again (a forward
    pre-hook), and inside each MoE experts block both GEMMs' inputs (the hidden rows and the
    gated activations) the same way (its eager forward runs with `F.linear` quantizing its
    input), as the fused MoE kernels do."""

    def quantized(x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return fake_quantize_act_groups(flat, BLOCK[1]).reshape(x.shape).to(x.dtype)

    def hook(_module: nn.Module, args: tuple) -> tuple:
        return (quantized(args[0]), *args[1:])

    def w8a8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return _LINEAR(quantized(x), weight, bias)

    def experts_w8a8(forward):
        def run(*args, **kwargs):
            with mock.patch.object(F, "linear", w8a8_linear):
                return forward(*args, **kwargs)
        return run

    experts = False
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.endswith("_proj") and "experts" not in name:
            module.register_forward_pre_hook(hook)
        elif name.endswith(".experts"):
            module.forward = experts_w8a8(module.forward)
            experts = True
    if experts:  # transformers' eager experts (a loop of F.linear), not its grouped_mm default
        model.set_experts_implementation("eager")
