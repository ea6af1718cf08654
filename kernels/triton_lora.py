"""Triton batched LoRA (Punica's BGMV shape: one program per token and output tile), reading
only each token's own adapter slot; kernels/lora_reference.py is the twin and states the
layout. A token with slot -1 (the base model) computes nothing: shrink writes zeros, expand
adds nothing. Slots are read on the device, so a decode CUDA graph replays with new slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Input features per shrink program (a multiple of its BLOCK_K).
_K_PER_SPLIT = 256


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, part_ptr, num_tokens, in_features, rank, k_per_split,
                   stride_xt, stride_as, stride_ar,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (t, p): token t's partial product over input columns [p k, (p + 1) k)
    t = tl.program_id(0)
    p = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        k_end = tl.minimum(in_features, (p + 1) * k_per_split)
        for k0 in range(p * k_per_split, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * stride_xt + k, mask=k < k_end, other=0.0)
            a = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                        mask=(r[:, None] < rank) & (k[None, :] < k_end), other=0.0)
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(part_ptr + (p * num_tokens + t) * BLOCK_R + r, acc)


@triton.jit
def _expand_kernel(y_ptr, b_ptr, slot_ptr, out_ptr, out_features, rank,
                   stride_yt, stride_bs, stride_bo, stride_br, stride_ot,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        y = tl.load(y_ptr + t * stride_yt + r, mask=r < rank, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + slot * stride_bs + n[:, None] * stride_bo + r[None, :] * stride_br,
                    mask=(n[:, None] < out_features) & (r[None, :] < rank), other=0.0)
        acc = tl.sum(b.to(tl.float32) * y[None, :], axis=1)
        o_ptr = out_ptr + t * stride_ot + n
        o = tl.load(o_ptr, mask=n < out_features, other=0.0)
        tl.store(o_ptr, (o.to(tl.float32) + acc).to(out_ptr.dtype.element_ty),
                 mask=n < out_features)


def lora_shrink(x: Tensor, lora_a: Tensor, token_slots: Tensor) -> Tensor:
    """Split over the input features (one program per token reads too little to fill the
    GPU at decode sizes); the partial sums are added by one deterministic reduction."""
    num_tokens, in_features = x.shape
    rank = lora_a.shape[1]
    a = lora_a if lora_a.stride(2) == 1 else lora_a.contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    block_r, block_k = triton.next_power_of_2(rank), 64
    splits = triton.cdiv(in_features, _K_PER_SPLIT)
    part = torch.empty(splits, num_tokens, block_r, dtype=torch.float32, device=x.device)
    if num_tokens:
        _shrink_kernel[(num_tokens, splits)](
            x, a, token_slots, part, num_tokens, in_features, rank, _K_PER_SPLIT, x.stride(0),
            a.stride(0), a.stride(1), BLOCK_R=block_r, BLOCK_K=block_k)
    return part.sum(0)[:, :rank].to(x.dtype)


def lora_expand(y: Tensor, lora_b: Tensor, token_slots: Tensor, out: Tensor) -> None:
    num_tokens, rank = y.shape
    out_features = lora_b.shape[1]
    block_n = 64
    if num_tokens:
        _expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
            y, lora_b, token_slots, out, out_features, rank, y.stride(0), lora_b.stride(0),
            lora_b.stride(1), lora_b.stride(2), out.stride(0),
            BLOCK_R=triton.next_power_of_2(rank), BLOCK_N=block_n)
