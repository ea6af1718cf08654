"""Which weight quantization a checkpoint declares or the `quantization` engine argument asks
for: the one place that turns them into an `Fp8Config` (or None), and the refusal at start of
every one this worker does not implement.

Supported: FP8 with block scales, either Qwen's FP8 checkpoints (`quantization_config:
{quant_method: fp8, fmt: e4m3, weight_block_size: [bn, bk], activation_scheme: dynamic}`:
e4m3 weights and a float32 `weight_scale_inv` per block) or `quantization: fp8` over a
BF16/FP32 checkpoint (quantized at load, 128x128 blocks). The parallel layers' linear method
(workers/layers/linear_method.py) reads the config; embeddings, the LM head, norms and the MoE
router stay unquantized, as in Qwen's checkpoints.

A checkpoint is quantized when a tensor has a non-float dtype (FP8, int) or a quantization
scale's name; a config that declares a `quantization_config` over weights that are not is
refused, since serving it would silently ignore the declaration. Tensor parallelism shards
whole scale blocks: `check_fp8_blocks` refuses at start a TP size that would split one; a
dim that is not split may end in a partial block (ceil-div scale grids), as in vLLM.
Imports only the standard library (the engine reads it before any worker starts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.checkpoint import tensor_dtypes

SUPPORTED_QUANTIZATIONS: tuple[str, ...] = ("fp8",)
DEFAULT_FP8_BLOCK = (128, 128)
_FLOAT_DTYPES = ("F32", "BF16", "F16")
# Tensor-name endings that only quantized checkpoints carry (FP8 block / per-tensor scales,
# GPTQ / AWQ packed weights and their scales and zeros).
_QUANT_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", "qweight", "qzeros",
                   "scales", "g_idx")
_SUPPORTED_TEXT = ", ".join(SUPPORTED_QUANTIZATIONS)
# The modules an FP8 checkpoint's linear method covers (embeddings, lm_head, routers: never).
_QUANTIZED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj")


@dataclass(slots=True, frozen=True)
class Fp8Config:
    """Block-scaled FP8 weights: `weight_block_size` (bn output rows, bk input columns) per
    float32 scale; `from_checkpoint`: the weights are stored e4m3 with their scales (else the
    float checkpoint is quantized at load)."""

    weight_block_size: tuple[int, int] = DEFAULT_FP8_BLOCK
    from_checkpoint: bool = True


def check_quantization_arg(quantization: str | None) -> None:
    """ValueError unless the `quantization` engine argument names a supported method (or None:
    take the checkpoint's weights as they are)."""
    if quantization is None or quantization in SUPPORTED_QUANTIZATIONS:
        return
    raise ValueError(f"quantization must be null (the checkpoint's weights as they are) or one "
                     f"of: {_SUPPORTED_TEXT}; got {quantization!r}")


def quantization_config(raw: dict[str, Any], path: Path, quantization: str | None = None,
                        load_format: str = "auto") -> Fp8Config | None:
    """The checkpoint's (config.json `quantization_config`) or the engine argument's weight
    quantization (a checkpoint's own wins: `quantization: fp8` over an FP8 checkpoint reads it as
    it is); ValueError for one this worker cannot serve or a declaration over unquantized
    weights. Reads only safetensors headers; none with `load_format` "dummy" (random weights
    in the declared format: there is no checkpoint to check the declaration against)."""
    check_quantization_arg(quantization)
    qc = raw.get("quantization_config")
    if qc is None:
        return None if quantization is None else Fp8Config(from_checkpoint=False)
    if not isinstance(qc, dict):
        raise ValueError(f"{path}/config.json: quantization_config must be an object; got {qc!r}")
    method = qc.get("quant_method")
    if load_format != "dummy" and not any(
            dtype not in _FLOAT_DTYPES or name.endswith(_QUANT_SUFFIXES)
            for name, dtype in tensor_dtypes(path).items()):
        raise ValueError(
            f"{path}/config.json declares quantization_config (quant_method {method!r}) but "
            f"its weights are not quantized (every tensor is one of {list(_FLOAT_DTYPES)} and "
            "none is a quantization scale); remove quantization_config from config.json")
    if method not in SUPPORTED_QUANTIZATIONS:
        raise ValueError(f"{path} is quantized with quantization_config.quant_method {method!r}, "
                         f"which is not supported; supported methods: {_SUPPORTED_TEXT} "
                         "(Qwen's block-scaled FP8 checkpoints)")
    return _fp8_checkpoint_config(qc, path)


def _fp8_checkpoint_config(qc: dict[str, Any], path: Path) -> Fp8Config:
    where = f"{path}/config.json quantization_config"
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}: fmt {qc['fmt']!r} is not supported; only 'e4m3'")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{where}: activation_scheme {qc['activation_scheme']!r} is not "
                         "supported; only 'dynamic' (activations scaled per token and group)")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{where}: weight_block_size must be two positive integers [bn, bk] "
                         f"(block-scaled FP8; per-tensor FP8 is not supported); got {block!r}")
    # Qwen's MoE checkpoints list their routers (and lm_head), which stay unquantized here too;
    # a projection left in BF16 would need a per-layer method this worker does not pick.
    skipped = [m for m in qc.get("modules_to_not_convert") or []
               if m.endswith(_QUANTIZED_MODULES) or ".experts." in m]
    if skipped:
        raise ValueError(f"{where}: modules_to_not_convert keeps {skipped[:4]} unquantized; this "
                         "worker quantizes every attention and MLP projection of an FP8 "
                         "checkpoint, so a checkpoint that leaves one in BF16 is not supported")
    return Fp8Config(weight_block_size=(block[0], block[1]), from_checkpoint=True)


def check_fp8_blocks(quant: Fp8Config, name: str, output_partition_sizes: list[int],
                     input_size: int, *, output_split: bool, input_split: bool,
                     tensor_parallel_size: int) -> None:
    """ValueError naming the sizes where one rank's share of a quantized weight (its packed
    parts' rows `output_partition_sizes`, `input_size` columns) would split a scale block, by
    vLLM's rule (`validate_fp8_block_shape`): a dim split over the ranks must be whole blocks
    on every rank; a merged weight's parts but the last must be whole blocks (their scale rows
    then line up); an unsplit dim may end in a partial block (Qwen's format: the scale grid is
    `ceil(N / bn) x ceil(K / bk)`)."""
    bn, bk = quant.weight_block_size
    parts = output_partition_sizes if output_split else output_partition_sizes[:-1]
    many = len(output_partition_sizes) > 1
    bad = [(f"{name} part {j}" if many else name, rows) for j, rows in enumerate(parts)
           if rows % bn]
    if input_split and input_size % bk:
        bad.append((name, sum(output_partition_sizes)))
    if not bad:
        return
    what, rows = bad[0]
    fix = ("choose a smaller tensor_parallel_size" if tensor_parallel_size > 1 else
           "a merged weight's parts other than the last must be whole blocks, so that their "
           "scale rows line up (as in vLLM)")
    raise ValueError(
        f"FP8 weights in [{bn}, {bk}] blocks: one rank's {what} is [{rows}, {input_size}] at "
        f"tensor_parallel_size={tensor_parallel_size}, which splits a scale block (a dim split "
        f"over the ranks, or a merged part, must be whole blocks); {fix}")
