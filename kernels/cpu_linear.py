"""Linear layers on CPU: oneDNN GEMMs on weights packed once at load (vLLM's CPU linear, in torch).

`pack_linear_weight` is the one place that decides whether a weight is packed; `linear` is
the one dispatch point every unquantized linear product goes through (the parallel layers'
`UnquantizedLinearMethod` and the LM head): the packed weight when there is one, `F.linear`
(MKL's sgemm on CPU, cuBLAS on CUDA) otherwise.

What is packed, measured on this project's CPU (AVX-512 BF16 / AMX, one torch thread,
docs/benchmarks.md "CPU path", issue #43): every bf16 weight, and fp32 weights of at least
`FP32_PACK_MIN_NUMEL` elements (the LM heads: vocabulary x hidden). `F.linear` in bf16 hands
oneDNN the plain `[out, in]` weight on every call; `torch.ops.mkldnn._reorder_linear_weight`
puts it in oneDNN's own layout once, and `_linear_pointwise` on that is faster at every batch
size measured (1 to 256 rows) for every Qwen3-0.6B projection and its LM head. In fp32 the
packed GEMM pays only on the LM head's weight (streamed once per step, where the layout
matters most); the projections stay on MKL's sgemm, where oneDNN's per-call set-up outweighs
the product at one row and on small (qwen3-tiny) layers.

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

# fp32 weights this large (2^24 elements: qwen3-tiny's 151936 x 128 LM head and up) are packed.
# A tp-2 rank's half of that head (9.7M) stays on MKL: cache-resident, its one-row GEMV beat the
# packed GEMM (docs/benchmarks.md, issue #43, "Concurrency 1").
FP32_PACK_MIN_NUMEL = 1 << 24


def pack_linear_weight(weight: Tensor) -> Tensor | None:
    """A oneDNN-packed copy of `weight [out, in]` when packing pays (on CPU with oneDNN built
    in: a bf16 weight, or an fp32 one of >= FP32_PACK_MIN_NUMEL elements), else None: the
    weight is then multiplied as it is."""
    if (weight.device.type != "cpu" or not torch.backends.mkldnn.is_available()
            or weight.dim() != 2):
        return None
    if not (weight.dtype == torch.bfloat16
            or (weight.dtype == torch.float32 and weight.numel() >= FP32_PACK_MIN_NUMEL)):
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
