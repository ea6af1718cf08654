"""Linear methods: how a parallel linear layer's weights are stored, loaded and multiplied
(vLLM's `LinearMethodBase`, smaller). The layer (workers/layers/linear.py) owns the sharding
geometry: which rows or columns of a checkpoint tensor this rank keeps; its method owns the
parameters and the GEMM, so the layer never branches on dtype.

* `UnquantizedLinearMethod`: `weight [out, in]` in the model's dtype, multiplied by
  `kernels.linear`; on CPU a bf16 weight is also packed once after loading into oneDNN's
  layout (`weight_packed`, kernels/cpu_linear.py decides when it pays), else None.
* `Fp8LinearMethod` (workers/quantization.py's `Fp8Config`): `weight` e4m3 `[out, in]` and
  `weight_scale_inv` float32 `[ceil(out / bn), ceil(in / bk)]` (an unsplit dim may end in a
  partial block, as in Qwen's format and vLLM), multiplied by `kernels.fp8_block_linear`
  (W8A8, activations quantized per token and bk group). A checkpoint's scales load through the
  layer's geometry counted in blocks; `quantization: fp8` loads the float weight and
  quantizes it in `process_weights_after_loading`, which the loader calls once every tensor
  is in. Every rank must hold whole blocks of a split dim, and a merged weight's parts but the
  last whole blocks: refused at construction naming the sizes (`check_fp8_blocks`). On CPU,
  which has no FP8 GEMM, the layer also keeps its weight dequantized to float32 from load
  (`weight_dequant`: what the torch twin made on every call, ~19x a bf16 step's time on
  Qwen3-0.6B shapes): the same products, and no memory saved (said once at load).

`make_linear_method(None | Fp8Config)` is the one place a layer's method is chosen.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch
from torch import Tensor, nn

import kernels
from kernels.fp8_reference import FP8_DTYPE, dequantize_weight_blocks, quantize_weight_blocks
from workers.quantization import Fp8Config, check_fp8_blocks


class LinearMethod(ABC):
    """Creates a layer's weight parameters and computes `x @ W.T` with them."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, output_partition_sizes: list[int],
                       input_size: int, dtype: torch.dtype) -> None:
        """Register `layer.weight` (and any scales) for this rank's `[sum(output sizes),
        input_size]` shard; `output_partition_sizes` are its packed parts (q, k, v; gate, up)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        """This rank's `x @ W.T` in x's dtype."""

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded tensors into what `apply` reads."""


def _param(t: Tensor, loader: object) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    p.weight_loader = loader
    return p


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module, output_partition_sizes: list[int],
                       input_size: int, dtype: torch.dtype) -> None:
        layer.weight = _param(torch.empty(sum(output_partition_sizes), input_size, dtype=dtype),
                              layer.weight_loader)
        layer.weight_packed = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The loaded weight packed for the CPU's GEMM when that pays (else it is used as is)."""
        layer.weight_packed = kernels.pack_linear_weight(layer.weight.data)

    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        return kernels.linear(x, layer.weight, layer.weight_packed)


class Fp8LinearMethod(LinearMethod):
    """Block-scaled FP8 weights (see the module docstring)."""

    def __init__(self, quant: Fp8Config) -> None:
        self.quant = quant
        self.block = quant.weight_block_size

    def create_weights(self, layer: nn.Module, output_partition_sizes: list[int],
                       input_size: int, dtype: torch.dtype) -> None:
        ws = layer.tp.world_size
        check_fp8_blocks(self.quant, type(layer).__name__, output_partition_sizes, input_size,
                         output_split=ws > 1 and not layer.input_is_split,
                         input_split=ws > 1 and layer.input_is_split, tensor_parallel_size=ws)
        out = sum(output_partition_sizes)
        bn, bk = self.block
        layer.weight_dequant = None  # (CPU: set once loaded)
        if not self.quant.from_checkpoint:  # quantized once loaded
            layer.weight = _param(torch.empty(out, input_size, dtype=dtype), layer.weight_loader)
            return
        layer.weight = _param(torch.empty(out, input_size, dtype=FP8_DTYPE), layer.weight_loader)
        layer.weight_scale_inv = _param(  # a partial last block has its own scale
            torch.empty(-(-out // bn), -(-input_size // bk), dtype=torch.float32),
            lambda param, loaded, shard_id=None: layer.weight_loader(param, loaded, shard_id,
                                                                     block=self.block))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.quant.from_checkpoint:
            q, scale = quantize_weight_blocks(layer.weight.data, self.block)
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        if layer.weight.device.type == "cpu":
            layer.weight_dequant = dequantize_weight_blocks(layer.weight.data,
                                                            layer.weight_scale_inv.data,
                                                            self.block)

    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = kernels.fp8_block_linear(flat, layer.weight, layer.weight_scale_inv, self.block,
                                       dequantized=layer.weight_dequant)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def make_linear_method(quant: Fp8Config | None) -> LinearMethod:
    """The linear method for a layer of a model whose config says `quant`."""
    return UnquantizedLinearMethod() if quant is None else Fp8LinearMethod(quant)


def process_weights_after_loading(model: nn.Module) -> None:
    """Every layer's post-load step (a linear layer's method's; the experts' own) (online quantization), then, on CUDA, the float
    copies handed back so the KV cache is sized after the weights' final bytes."""
    for module in model.modules():
        if module is not model and hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    dequant = sum(t.nbytes for m in model.modules()
                  for t in ((getattr(m, "weight_dequant", None),)
                            + (getattr(m, "dequantized", None) or ()))
                  if isinstance(t, torch.Tensor))
    if dequant:
        logging.getLogger(__name__).info(
            "FP8 weights on CPU: the linear layers and experts also keep their weights "
            "dequantized (%.2f GiB; the CPU has no FP8 GEMM), so FP8 saves no memory here",
            dequant / 2**30)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
