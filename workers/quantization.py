"""Which weight quantization a checkpoint declares or the `quantization` engine argument asks
for, and the refusal at start of every one this worker does not implement.

Supported today: none (`SUPPORTED_QUANTIZATIONS` is empty). FP8 weights, Qwen's
`quant_method: fp8` checkpoints and `quantization: fp8` online, wait for a "linear method"
interface of the parallel layers; until then they are refused by name instead of failing
later on a scale tensor the model has no parameter for. A checkpoint is quantized when a
tensor has a non-float dtype (FP8, int) or a quantization scale's name; a config that declares
a `quantization_config` over weights that are not is refused too, since serving it would
silently ignore the declaration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.checkpoint import tensor_dtypes

SUPPORTED_QUANTIZATIONS: tuple[str, ...] = ()
_FLOAT_DTYPES = ("F32", "BF16", "F16")
# Tensor-name endings that only quantized checkpoints carry (FP8 block / per-tensor scales,
# GPTQ / AWQ packed weights and their scales and zeros).
_QUANT_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", "qweight", "qzeros",
                   "scales", "g_idx")
_SUPPORTED_TEXT = ", ".join(SUPPORTED_QUANTIZATIONS) or "none yet"
_FP8_NOT_YET = ("FP8 weights are not supported yet; serve the model's BF16 checkpoint instead "
                "(e.g. Qwen/Qwen3-8B for Qwen/Qwen3-8B-FP8)")


def check_quantization_arg(quantization: str | None) -> None:
    """ValueError unless the `quantization` engine argument names a supported method (or None:
    take the checkpoint's weights as they are)."""
    if quantization is None or quantization in SUPPORTED_QUANTIZATIONS:
        return
    if quantization == "fp8":
        raise ValueError(f"quantization 'fp8': {_FP8_NOT_YET}; leave quantization unset (null)")
    raise ValueError(f"quantization must be null (no quantization); supported methods: "
                     f"{_SUPPORTED_TEXT}; got {quantization!r} (FP8 weights, 'fp8', are not "
                     "supported yet)")


def check_checkpoint_quantization(raw: dict[str, Any], path: Path) -> None:
    """ValueError when config.json declares a `quantization_config` this worker cannot serve,
    or declares one over unquantized weights; reads only the safetensors headers."""
    qc = raw.get("quantization_config")
    if qc is None:
        return
    if not isinstance(qc, dict):
        raise ValueError(f"{path}/config.json: quantization_config must be an object; got {qc!r}")
    method = qc.get("quant_method")
    dtypes = tensor_dtypes(path)
    quantized = sorted(name for name, dtype in dtypes.items()
                       if dtype not in _FLOAT_DTYPES or name.endswith(_QUANT_SUFFIXES))
    if not quantized:
        raise ValueError(
            f"{path}/config.json declares quantization_config (quant_method {method!r}) but "
            f"its weights are not quantized (every tensor is one of {list(_FLOAT_DTYPES)} and "
            "none is a quantization scale); remove quantization_config from config.json")
    if method in SUPPORTED_QUANTIZATIONS:
        return
    if method == "fp8":
        raise ValueError(f"{path} is an FP8 checkpoint (quantization_config.quant_method 'fp8', "
                         f"its {quantized[0]!r} is {dtypes[quantized[0]]}): {_FP8_NOT_YET}")
    raise ValueError(f"{path} is quantized with quantization_config.quant_method {method!r}, "
                     f"which is not supported; supported methods: {_SUPPORTED_TEXT} "
                     f"({_FP8_NOT_YET})")
