"""Linear layers on CPU: oneDNN GEMMs on weights packed once at load (vLLM's CPU linear, in torch).

`pack_linear_weight` is the one place that decides whether a weight is packed; `linear` is
the one dispatch point every unquantized linear product goes through (the parallel layers'
`UnquantizedLinearMethod` and the LM head): the packed weight when there is one, `F.linear`
(MKL's sgemm on CPU, cuBLAS on CUDA) otherwise.

What is packed, measured on this project's CPU (AVX-512 BF16 / AMX, one torch thread,
docs/benchmarks.md "CPU path", issue #43): bf16 weights. `F.linear` in bf16 hands oneDNN
the plain `[out, in]` weight on every call; `torch.ops.mkldnn._reorder_linear_weight` puts it
in oneDNN's own layout once, and `_linear_pointwise` on that is faster at every batch size
measured (1 to 256 rows) for every Qwen3-0.6B projection and its LM head. fp32 weights stay
on MKL: oneDNN's packed fp32 GEMM won at some batch sizes and lost at one row and on small
(qwen3-tiny) layers, where its per-call set-up outweighs the product.

Invariants:
- A packed weight is an opaque oneDNN tensor beside the layer's plain `weight`, which stays
  what the checkpoint loaded (what tests, LoRA's shapes and tied embeddings read); the packed
  copy is made after loading and never written again.
- `linear(x, w, packed)` equals `F.linear(x, w)` up to the dtype's summation-order rounding
  (the same products, summed in oneDNN's order); no packing on CUDA or without oneDNN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

PACKED_DTYPES = (torch.bfloat16,)


def pack_linear_weight(weight: Tensor) -> Tensor | None:
    """A oneDNN-packed copy of `weight [out, in]` when packing pays (a bf16 weight on CPU with
    oneDNN built in), else None: the weight is then multiplied as it is."""
    if (weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES
            or not torch.backends.mkldnn.is_available() or weight.dim() != 2):
        return None
    # No batch-size hint: the packed layout then serves every row count a step brings.
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def linear(x: Tensor, weight: Tensor, packed: Tensor | None = None) -> Tensor:
    """`x @ weight.T` (x `[..., in]`), through `packed` (from `pack_linear_weight`) when given."""
    if packed is None:
        return F.linear(x, weight)
    if x.dtype != packed.dtype:
        raise ValueError(f"activations are {x.dtype} but the packed weight is {packed.dtype}; "
                         "cast the input to the layer's dtype")
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
