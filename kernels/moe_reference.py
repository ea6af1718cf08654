"""Plain-torch mixture-of-experts: the routing and expert MLPs of Qwen3-MoE, no per-expert loop.

`fused_moe` is the twin of `kernels.triton_moe.fused_moe` (the CPU path, and the oracle the
Triton kernel is tested against). The (token, slot) pairs are sorted by expert and each
projection is one `torch.nn.functional.grouped_mm` over the per-expert row groups: every
expert's weights are read in place, only for the experts that got rows, with no padding and
no host read. The loop over groups is inside that one op, not in Python.

`topk_ids` are this rank's expert indices; -1 marks a (token, slot) whose expert lives on
another rank (expert parallelism): it contributes zero here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.fp8_reference import fake_quantize_act_groups


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """transformers' Qwen3MoeTopKRouter: softmax in fp32, top-k, optional renormalisation;
    returns (weights `[T, k]` in the logits' dtype, expert ids `[T, k]` int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              act_group: int | None = None) -> Tensor:
    """`sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e x_t) * (up_e x_t))` with `e = topk_ids[t, j]`.

    x `[T, H]`, w13 `[E, 2I, H]` (gate rows then up rows), w2 `[E, H, I]`; returns `[T, H]`.
    With `act_group` (FP8 experts, W8A8: the twin of the Triton kernel's on-the-fly
    quantization), each GEMM's input rows are quantized per `act_group` columns to e4m3 and
    dequantized again first (kernels/fp8_reference.py); w13/w2 are then the dequantized experts.
    """
    def gemm_input(a: Tensor) -> Tensor:
        return a if act_group is None else fake_quantize_act_groups(a, act_group).to(a.dtype)

    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    # Pairs for other ranks' experts sort last (key E), past every group's rows.
    key = torch.where(flat >= 0, flat, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    group_ends = torch.cumsum(counts[:num_experts], 0).to(torch.int32)
    rows = gemm_input(x)[order // top_k]
    gate_up = F.grouped_mm(rows, w13.transpose(1, 2), offs=group_ends)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    down = F.grouped_mm(gemm_input(act), w2.transpose(1, 2), offs=group_ends)
    # Rows past the last group (other ranks' pairs) were never computed: select, not multiply.
    local = (key[order] < num_experts)[:, None]
    down = torch.where(local, down * topk_weights.reshape(-1)[order, None].to(x.dtype), 0.0)
    out = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    out[order] = down
    return out.view(num_tokens, top_k, hidden).sum(dim=1)


def moe_align_block_size(topk_ids: Tensor, num_experts: int, block_m: int
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """Group the (token, slot) pairs by expert in blocks of `block_m` rows (vLLM's step).

    Returns `sorted_ids` `[P]` (pair index `t * k + j`, or `T * k` for padding),
    `expert_ids` `[P // block_m]` (the block's expert; -1 for the pairs of other ranks'
    experts and for blocks past the end) and `num_padded` `[1]` (rows in use), with the
    static size P = T*k + (E + 1) * (block_m - 1) rounded up to block_m. The reference for
    kernels/triton_moe.py's three-launch version (the ~20 small torch ops here would be ~20
    launches per layer on a GPU); fixed shapes, no host read.
    """
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    # Bin E collects pairs for other ranks' experts; its blocks get expert id -1.
    key = torch.where(flat >= 0, flat, num_experts)
    bins = num_experts + 1
    counts = torch.zeros(bins, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    first = torch.cumsum(counts, 0) - counts
    dest = padded_start[sorted_key] + torch.arange(num_pairs, device=device) - first[sorted_key]
    size = -(-(num_pairs + bins * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, size, block_m, device=device)
    block_bin = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(block_bin < num_experts, block_bin, -1).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)
