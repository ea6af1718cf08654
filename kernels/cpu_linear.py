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

An fp32 weight that is packed and at most `FP32_T_MAX_BYTES` (a narrow model's LM head:
qwen3-tiny's, or a tp-2 rank's half of it) also keeps a transposed copy for the product of one
row (`transpose_linear_weight`): MKL's GEMV over `[in, out]` streams the weight once,
axpy-fashion, at the memory's speed, where oneDNN's packed GEMM reached half of it. A served
decode step at concurrency 1 is that product: qwen3-tiny's head at one row, one thread, weights
streamed from memory, 4.1 ms against 7.3 packed (a tp-2 half: 2.1 against 4.1 packed and 5.9 for
the `W x^T` it had); from two rows on the packed GEMM serves (at exactly two `W x^T` was ~20 %
ahead on one thread, behind on two; from eight the packed GEMM leads by 1.4x and more:
docs/benchmarks.md, "The LM head at one row", issue #43). The copy is held as
`T_BLOCKS` blocks of columns, `[T_BLOCKS, in, out / T_BLOCKS]`, and the row multiplies them as
one batched GEMM: MKL runs a one-row sgemm on one thread whatever torch's count, while torch
spreads a bmm's batch over its threads, so a head given an idle core (workers/cpu_threads.py)
streams on both (qwen3-tiny's head, 2 threads: 3.7 -> 2.6 ms; on one thread the same as one
GEMV: docs/benchmarks.md "The one-row head in column blocks"). A wide head's copy would cost its
hundreds of MB again for a smaller gain (at hidden 1024, 2 threads: slower).

Invariants:
- A packed weight is an opaque oneDNN tensor beside the layer's plain `weight`, which stays
  what the checkpoint loaded (what tests, LoRA's shapes and tied embeddings read); the packed
  and transposed copies are made after loading and never written again.
- `linear(x, w, packed, transposed)` equals `F.linear(x, w)` up to the dtype's
  summation-order rounding (the same products, summed in oneDNN's or MKL's order); no packed
  or transposed copy on CUDA or without oneDNN. A transposed copy's columns past `out` (the
  last block's padding, where T_BLOCKS does not divide it) are zeros, never returned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# fp32 weights this large (2^23 elements: a tp-2 rank's half of qwen3-tiny's 151936 x 128 LM
# head, 9.7M, and up) are packed: at 1 to 64 rows, weights streamed from memory (this CPU's L3
# is 32 MiB), the packed half head ran 1.6-1.9x `F.linear` (docs/benchmarks.md, issue #43, "The
# LM head at one row"; an earlier host with a 300 MiB L3 kept it cache-resident, where MKL won).
FP32_PACK_MIN_NUMEL = 1 << 23

# The largest packed fp32 weight that also keeps a transposed copy for one-row products.
FP32_T_MAX_BYTES = 1 << 27

# Column blocks of that copy, one bmm batch entry each: enough for the 1, 2 or 4 threads a CPU
# rank runs (2 threads: 2 and 4 blocks 3.1 / 2.4 ms on qwen3-tiny's head, 8 blocks 2.5).
T_BLOCKS = 4


def _packs(weight: Tensor) -> bool:
    """On CPU with oneDNN built in: a 2-D bf16 weight, or an fp32 one of >= FP32_PACK_MIN_NUMEL
    elements."""
    return (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and weight.dim() == 2
            and (weight.dtype == torch.bfloat16
                 or (weight.dtype == torch.float32 and weight.numel() >= FP32_PACK_MIN_NUMEL)))


def pack_linear_weight(weight: Tensor) -> Tensor | None:
    """A oneDNN-packed copy of `weight [out, in]` when packing pays (on CPU with oneDNN built
    in: a bf16 weight, or an fp32 one of >= FP32_PACK_MIN_NUMEL elements), else None: the
    weight is then multiplied as it is."""
    if not _packs(weight):
        return None
    # No batch-size hint: the packed layout then serves every row count a step brings.
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def transpose_linear_weight(weight: Tensor) -> Tensor | None:
    """A transposed copy of `weight [out, in]` in T_BLOCKS blocks of ceil(out / T_BLOCKS)
    columns, `[T_BLOCKS, in, cols]` contiguous (block b holds rows [b * cols, (b + 1) * cols),
    zeros past `out`), for one-row products, when it pays (an fp32 weight that
    `pack_linear_weight` packs, of at most FP32_T_MAX_BYTES), else None."""
    if (weight.dtype != torch.float32 or not _packs(weight)
            or weight.numel() * weight.element_size() > FP32_T_MAX_BYTES):
        return None
    out, inp = weight.shape
    cols = -(-out // T_BLOCKS)
    blocks = weight.new_zeros(T_BLOCKS, inp, cols)
    for b in range(T_BLOCKS):
        rows = weight[b * cols:(b + 1) * cols]
        blocks[b, :, :rows.shape[0]].copy_(rows.t())
    return blocks


def linear(x: Tensor, weight: Tensor, packed: Tensor | None = None,
           transposed: Tensor | None = None) -> Tensor:
    """`x @ weight.T` (x `[..., in]`): one row (x `[1, in]`) through `transposed` (from
    `transpose_linear_weight`) when given, else through `packed` (from `pack_linear_weight`)
    when given."""
    if transposed is not None and x.dim() == 2 and x.shape[0] == 1:
        # [blocks, 1, cols], its blocks in column order: the row's [1, blocks * cols] as it is.
        y = torch.bmm(x.expand(transposed.shape[0], 1, x.shape[1]), transposed)
        y = y.view(1, -1)
        return y if y.shape[1] == weight.shape[0] else y[:, :weight.shape[0]]
    if packed is None:
        return F.linear(x, weight)
    if x.dtype != packed.dtype:
        raise ValueError(f"activations are {x.dtype} but the packed weight is {packed.dtype}; "
                         "cast the input to the layer's dtype")
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
