"""Fused mixture-of-experts in Triton: two grouped GEMMs over tokens grouped by expert.

1. `moe_align_block_size` lays the (token, slot) pairs out by expert in blocks of BLOCK_M
   rows, each block one expert, in three small launches (count per expert with atomics;
   one program for the padded offsets, each block's expert and the padding fill; place
   every pair at its expert's cursor with atomics). Within an expert the pairs' order
   follows the atomics, which changes no result: every row of a GEMM is its own. The torch
   twin (kernels/moe_reference.py) is the stable-order reference it is tested against.
2. `_moe_gemm_kernel` with GATED: every program multiplies one block of rows by one
   BLOCK_N slice of its expert's gate and up rows (two accumulators sharing the loaded
   activations) and stores `silu(gate) * up` `[T*k, I]`: the gate/up output never exists.
3. The same kernel without GATED: `[T*k, I] @ w2[e].T`, scaled by each pair's routing weight
   `[T*k, H]`; the k slots of a token are then summed (one `sum` over a view, no atomics, so
   the result is deterministic).

Block-scaled FP8 experts (kernels/fp8_reference.py's format, `[E, N, K]` e4m3 with
`[E, N / bn, K / bk]` float32 scales) are W8A8, as the dense GEMM (kernels/triton_fp8.py): the
K loop steps one scale block at a time (BLOCK_K == bk), quantizes the loaded A tile per row on
the fly (amax / 448, rounded to e4m3: `triton_kv.to_cache`; both GEMMs, so the gated
activations too), takes the e4m3 x e4m3 dot product with the B tile as stored, and adds it
times the rows' scales and the columns' block scales to the float32 accumulator. No float copy
of the experts or quantized copy of the activations is ever written. Under the interpreter
(CPU tests) the dot runs on the e4m3 values widened to float32: the same products.

No host read anywhere (the grid is the static worst case, blocks past the used rows exit
at once), so the decode CUDA graph captures it. Blocks of pairs whose expert lives on another
rank (expert id -1) store zeros.

Tile sizes: `_TILE_TABLE` is PROVISIONAL. It follows the shape of vLLM's H100 tables for
E=128, N=768 (small BLOCK_M for decode, 64-row tiles for prefill), not our own measurement:
no GPU was lent when this was written. To measure it on a Hopper GPU, run
`python bench/moe_bench.py --device cuda --sweep-tiles` and put the best tiles per token
count into the table (see docs/benchmarks.md). Its rows are sized for 2-byte activations
(bf16, fp16); `tile_config` gives wider ones (fp32) a proportionally smaller BLOCK_K, so a
pipeline stage's A and B tiles hold the bytes they hold in bf16: fp32 at the bf16 tiles needed
up to 240 KiB of shared memory, over an H100's 227 (a launch fails: Triton's OutOfResources).
tests/kernels/sm90_compile_moe.py compiles every row as `tile_config` gives it in every
activation dtype and checks each against that limit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_fp8 import INTERPRET
from kernels.triton_kv import to_cache

# (max pairs T*k, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): the first row
# whose bound covers the batch, for activations of _TABLE_ELEMENT_BYTES. PROVISIONAL (see the
# module docstring).
_TILE_TABLE = (
    (64, 16, 64, 128, 1, 4, 4),
    (512, 32, 64, 128, 8, 4, 4),
    (4096, 64, 128, 64, 8, 4, 4),
    (2**62, 64, 128, 64, 8, 8, 3),
)
_TABLE_ELEMENT_BYTES = 2


def tile_config(num_pairs: int, dtype: torch.dtype) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) for T*k pairs of `dtype`
    activations: the table's row, its BLOCK_K divided by how much wider than the table's
    elements `dtype`'s are (fp32: halved), so a stage's A and B tiles keep their bytes."""
    widen = max(1, dtype.itemsize // _TABLE_ELEMENT_BYTES)
    for bound, block_m, block_n, block_k, *rest in _TILE_TABLE:
        if num_pairs <= bound:
            tiles = (block_m, block_n, max(16, block_k // widen), *rest)
            return tiles  # type: ignore[return-value]
    raise AssertionError("the last row's bound covers every batch")


# num_pairs (tokens x top_k) changes every step: never specialised, one compile serves all.
@triton.jit(do_not_specialize=["num_pairs"])
def _align_count_kernel(topk_ids_ptr, counts_ptr, num_pairs, num_experts, BLOCK: tl.constexpr):
    """counts[e] += pairs routed to local expert e (bin num_experts: other ranks' experts)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_pairs
    e = tl.load(topk_ids_ptr + offs, mask=ok, other=0)
    key = tl.where(e >= 0, e, num_experts)
    tl.atomic_add(counts_ptr + key, 1, mask=ok)


@triton.jit(do_not_specialize=["num_pairs", "size"])
def _align_offsets_kernel(counts_ptr, starts_ptr, expert_ids_ptr, num_padded_ptr,
                          sorted_ids_ptr, num_pairs, num_experts, size,
                          BLOCK_M: tl.constexpr, BINS: tl.constexpr, FILL: tl.constexpr):
    """One program: each bin's padded start, each row block's expert (-1 for other ranks'
    pairs and unused blocks), the rows in use, and the padding value in every row."""
    bins = tl.arange(0, BINS)
    in_use = bins <= num_experts
    counts = tl.load(counts_ptr + bins, mask=in_use, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(starts_ptr + bins, starts, mask=in_use)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    is_expert = bins < num_experts
    for first in range(0, size // BLOCK_M, FILL):
        block = first + tl.arange(0, FILL)
        row = (block * BLOCK_M)[:, None]
        owns = (row >= starts[None, :]) & (row < ends[None, :]) & is_expert[None, :]
        expert = tl.sum(tl.where(owns, bins[None, :] + 1, 0), 1) - 1
        tl.store(expert_ids_ptr + block, expert, mask=block < size // BLOCK_M)
    for first in range(0, size, FILL * BLOCK_M):
        rows = first + tl.arange(0, FILL * BLOCK_M)
        tl.store(sorted_ids_ptr + rows, tl.full((FILL * BLOCK_M,), 0, tl.int32) + num_pairs,
                 mask=rows < size)


@triton.jit(do_not_specialize=["num_pairs"])
def _align_place_kernel(topk_ids_ptr, starts_ptr, cursor_ptr, sorted_ids_ptr, num_pairs,
                        num_experts, BLOCK: tl.constexpr):
    """sorted_ids[start[e] + cursor[e]++] = pair, for every pair of expert (bin) e."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_pairs
    e = tl.load(topk_ids_ptr + offs, mask=ok, other=0)
    key = tl.where(e >= 0, e, num_experts)
    slot = tl.atomic_add(cursor_ptr + key, 1, mask=ok)
    start = tl.load(starts_ptr + key, mask=ok, other=0)
    tl.store(sorted_ids_ptr + start + slot, offs, mask=ok)


_ALIGN_BLOCK = 1024
_ALIGN_FILL = 16


def moe_align_block_size(topk_ids: Tensor, num_experts: int, block_m: int
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """kernels.moe_reference.moe_align_block_size in four launches (a zero fill, three
    kernels); same shapes and values, except the order of pairs inside an expert's rows."""
    num_pairs = topk_ids.numel()
    bins = num_experts + 1
    size = triton.cdiv(num_pairs + bins * (block_m - 1), block_m) * block_m
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    scratch = torch.zeros(3, bins, dtype=torch.int32, device=device)  # counts, cursors, starts
    sorted_ids = torch.empty(size, dtype=torch.int32, device=device)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    grid = (triton.cdiv(num_pairs, _ALIGN_BLOCK),)
    _align_count_kernel[grid](ids, scratch[0], num_pairs, num_experts, BLOCK=_ALIGN_BLOCK)
    _align_offsets_kernel[(1,)](scratch[0], scratch[2], expert_ids, num_padded, sorted_ids,
                                num_pairs, num_experts, size, BLOCK_M=block_m,
                                BINS=triton.next_power_of_2(bins), FILL=_ALIGN_FILL)
    _align_place_kernel[grid](ids, scratch[2], scratch[1], sorted_ids, num_pairs, num_experts,
                              BLOCK=_ALIGN_BLOCK)
    return sorted_ids, expert_ids, num_padded


@triton.jit
def _fp8_dot(aq, b, DOT_FP8: tl.constexpr):
    """e4m3 A (as float32 values) times e4m3 B, in float32: on the tensor cores' e4m3 path,
    or (the interpreter) widened to float32, where every product is exact."""
    if DOT_FP8:
        return tl.dot(aq.to(tl.float8e4nv), b)
    return tl.dot(aq, b.to(tl.float32), input_precision="ieee")


@triton.jit(do_not_specialize=["num_pairs", "num_rows_total"])
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, bs_ptr,
    N, K, num_pairs, num_rows_total,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_bse, stride_bsn,
    TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr, GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_W: tl.constexpr, SCALE_N: tl.constexpr, DOT_FP8: tl.constexpr,
):
    """C[pair, n] for one (row block, column block). A's row for a pair is its token
    (`pair // TOP_K`) when A_PER_TOKEN, else the pair itself. With GATED, B's rows n and
    N + n are gate and up, and C gets silu(gate) * up."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_rows_total, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row blocks share each column block while it is in L2.
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % size_m
    pid_n = (pid % (GROUP_M * num_pid_n)) // size_m
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = row_ok[:, None] & col_ok[None, :]
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:  # pairs routed to another rank's experts contribute nothing here
        tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return
    a_row = pair // TOP_K if A_PER_TOKEN else pair
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if FP8_W:  # W8A8: this K block's A rows quantized, the block scales per column
            a32 = a.to(tl.float32)
            a_scale = tl.maximum(tl.max(tl.abs(a32), axis=1), 1e-10) / 448.0
            aq = to_cache(a32, a_scale[:, None], True)  # e4m3 values (rounded), as float32
            s_ptrs = bs_ptr + expert * stride_bse + k0  # (BLOCK_K == SCALE_K)
            s = tl.load(s_ptrs + (offs_n // SCALE_N) * stride_bsn, mask=col_ok, other=0.0)
            acc += _fp8_dot(aq, b, DOT_FP8) * a_scale[:, None] * s[None, :]
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=b_mask, other=0.0)
                s_up = tl.load(s_ptrs + ((N + offs_n) // SCALE_N) * stride_bsn, mask=col_ok,
                               other=0.0)
                acc_up += _fp8_dot(aq, b_up, DOT_FP8) * a_scale[:, None] * s_up[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=b_mask, other=0.0)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
        acc = acc * w[:, None].to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _launch(a: Tensor, b: Tensor, c: Tensor, weights: Tensor, sorted_ids: Tensor,
            expert_ids: Tensor, num_padded: Tensor, n: int, top_k: int, a_per_token: bool,
            gated: bool, mul_weight: bool, tiles: tuple[int, ...],
            b_scale: Tensor | None = None, block: tuple[int, int] = (1, 1)) -> None:
    block_m, block_n, block_k, group_m, num_warps, num_stages = tiles
    rows = sorted_ids.shape[0]
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, block_n),)
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    scale = b if b_scale is None else b_scale
    _moe_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, expert_ids, num_padded, scale,
        n, b.shape[2], c.shape[0], rows,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        scale.stride(0), scale.stride(1),
        TOP_K=top_k, A_PER_TOKEN=a_per_token, GATED=gated, MUL_WEIGHT=mul_weight,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        DOT_PRECISION=precision, FP8_W=b_scale is not None, SCALE_N=block[0],
        DOT_FP8=not INTERPRET, num_warps=num_warps, num_stages=num_stages)


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              tiles: tuple[int, ...] | None = None, w13_scale: Tensor | None = None,
              w2_scale: Tensor | None = None, block: tuple[int, int] | None = None) -> Tensor:
    """See kernels.ops.fused_moe; `tiles` overrides the table (benchmark sweeps, tests)."""
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    tiles = tiles or tile_config(num_pairs, x.dtype)
    if block is not None:  # FP8: the K loop steps one scale block (one activation group)
        block_m, block_n, _, *rest = tiles
        tiles = (block_m, block_n, block[1], *rest)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, num_experts, tiles[0])
    weights = topk_weights.reshape(-1)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _launch(x, w13, act, weights, sorted_ids, expert_ids, num_padded, inter, top_k,
            a_per_token=True, gated=True, mul_weight=False, tiles=tiles, b_scale=w13_scale,
            block=block or (1, 1))
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _launch(act, w2, out, weights, sorted_ids, expert_ids, num_padded, hidden, 1,
            a_per_token=False, gated=False, mul_weight=True, tiles=tiles, b_scale=w2_scale,
            block=block or (1, 1))
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
