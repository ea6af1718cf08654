"""Where an FP8 KV cache's scales come from (`Attention.k_scale` / `v_scale`, float32
`[Hkv]` buffers, one per KV head of this rank, that the KV-write and attention kernels read;
1.0 by default; a per-tensor scale is the vector filled with it):

* the checkpoint's `model.layers.{i}.self_attn.k_scale` / `v_scale` (llm-compressor's names),
  one value (every head's) or one per KV head: each rank takes its own heads' values, sharded
  with the KV heads (a rank holding a replicated KV head, tp > Hkv, takes that head's);
* `calculate_kv_scales: true`: from the first step after start-up (the first request's
  prefill; a speculative draft's layers from its own first forward), vLLM's per-tensor rule
  `amax(K) / 200` and `amax(V) / 100` over this rank's rows (headroom for later tokens larger
  than the first prompt's), filling the vector; that step's K/V are stored again under the
  new scales, so no cached value was ever written under another scale. Calculated scales win
  over a checkpoint's, as in vLLM.

Scales are fixed after that: the cache's contents (swap, offload, prefix hits, copy-on-write)
are read with the scales they were written with. A full-precision cache ignores them.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn

import kernels

K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
_MIN_SCALE = 1e-12
# llm-compressor's KV-cache scale tensors
KV_SCALE_TENSOR = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


def apply_checkpoint_kv_scales(model: nn.Module, scales: dict[str, Tensor]) -> None:
    """Set each attention layer's scales from the checkpoint's tensors (`KV_SCALE_TENSOR`
    names); ValueError for a layer the model lacks, a shape that is neither one value nor one
    per KV head, or a value that is not a positive finite number."""
    layers = model.model.layers
    for name, tensor in scales.items():
        m = KV_SCALE_TENSOR.match(name)
        index, kind = int(m.group(1)), m.group(2)
        if index >= len(layers):
            raise ValueError(f"checkpoint tensor {name!r} is for layer {index}, but the model "
                             f"has {len(layers)} layers")
        attn = layers[index].self_attn
        values = _rank_scales(tensor.float().flatten(), attn.qkv_proj, name)
        getattr(attn.attn, f"{kind}_scale").copy_(values)


def _rank_scales(values: Tensor, qkv_proj: nn.Module, name: str) -> Tensor:
    """This rank's KV heads' scales `[num_kv_heads]` from a checkpoint's one or per-head values."""
    total = qkv_proj.total_num_kv_heads
    if values.numel() == total:
        values = values[qkv_proj.kv_head_start:qkv_proj.kv_head_start + qkv_proj.num_kv_heads]
    elif values.numel() != 1:
        raise ValueError(f"checkpoint tensor {name!r} has {values.numel()} values; a KV-cache "
                         f"scale is one value or one per KV head ({total})")
    if not bool(torch.isfinite(values).all()) or bool((values <= 0).any()):
        raise ValueError(f"checkpoint tensor {name!r} holds {values.tolist()}; KV-cache scales "
                         "must be positive and finite")
    return values.expand(qkv_proj.num_kv_heads)


def arm_kv_scale_calculation(attention_layers: list[nn.Module]) -> None:
    """`calculate_kv_scales`: the next step (the first real one) sets these layers' scales;
    once only, so a cache rebuilt later (park/wake) keeps them."""
    for attn in attention_layers:
        attn.kv_scales_pending = not attn.kv_scales_calculated


def calculate_kv_scales(attn: nn.Module, k: Tensor, v: Tensor, slot_mapping: Tensor,
                        backend: str) -> None:
    """Set `attn`'s scales (every head's the same: vLLM's per-tensor rule) from this step's
    K/V rows `[T, Hkv, D]` (slots -1 skipped) and store the rows again under them."""
    keep = slot_mapping >= 0
    attn.k_scale.copy_((k[keep].abs().amax().float() / K_SCALE_CONSTANT).clamp(min=_MIN_SCALE))
    attn.v_scale.copy_((v[keep].abs().amax().float() / V_SCALE_CONSTANT).clamp(min=_MIN_SCALE))
    k_cache, v_cache = attn.kv_cache()
    kernels.write_kv(k, v, k_cache, v_cache, slot_mapping, backend=backend,
                     k_scale=attn.k_scale, v_scale=attn.v_scale)
    attn.kv_scales_pending = False
    attn.kv_scales_calculated = True
