"""Compile the fused-MoE kernels for an H100 (sm_90) without a GPU (see sm90_compile.py,
whose helper this uses): the three alignment kernels, and the GEMM at every row of
`_TILE_TABLE` as `tile_config` picks it for each activation dtype the launcher takes (bf16,
the GPU default; fp16; fp32, whose rows take a smaller BLOCK_K), gate+up (GATED, rows per
token) and down (routing weights applied), with float experts of the activations' dtype and
with block-scaled FP8 experts (128x128 blocks, W8A8: e4m3 dot products, BLOCK_K 128). Every
GEMM must fit an H100's shared memory: compiling does not check it, a launch does (Triton's
OutOfResources). Run with TRITON_INTERPRET unset."""

from __future__ import annotations

import torch
from sm90_compile import add_job, compile_all

from kernels import triton_moe

# An H100's shared memory per block (227 KiB): a launch above it fails, compiling does not.
H100_SHARED_BYTES = 232448
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP8_BLOCK = 128


def main() -> None:
    """Every configuration compiles in compile_all's pool (LLVM and ptxas are single-threaded);
    each GEMM's shared memory is checked once all have compiled, and every one over the limit
    is named."""
    jobs: list[tuple] = []
    gemms: list[tuple] = []  # (what, job index) of each GEMM configuration
    for dt, dtype in DTYPES.items():
        for bound, *_ in triton_moe._TILE_TABLE:
            block_m, block_n, block_k, group_m, warps, stages = triton_moe.tile_config(bound,
                                                                                        dtype)
            for fp8 in (False, True):
                bk = FP8_BLOCK if fp8 else block_k  # FP8: the K loop steps one scale block
                for gated in (True, False):
                    gemms.append(((dt, fp8, block_m, block_n, bk, warps, stages, gated),
                                  len(jobs)))
                    add_job(jobs, triton_moe._moe_gemm_kernel,
                            dict(a_ptr=dt, b_ptr="fp8e4nv" if fp8 else dt, c_ptr=dt,
                                 weights_ptr="fp32", sorted_ids_ptr="i32", expert_ids_ptr="i32",
                                 num_padded_ptr="i32", bs_ptr="fp32" if fp8 else dt),
                            dict(TOP_K=8 if gated else 1, A_PER_TOKEN=gated, GATED=gated,
                                 MUL_WEIGHT=not gated, BLOCK_M=block_m, BLOCK_N=block_n,
                                 BLOCK_K=bk, GROUP_M=group_m,
                                 DOT_PRECISION="ieee" if dt == "fp32" else "tf32", FP8_W=fp8,
                                 SCALE_N=FP8_BLOCK if fp8 else 1, DOT_FP8=fp8),
                            num_warps=warps, num_stages=stages)
    for ids in ("i64", "i32"):
        add_job(jobs, triton_moe._align_count_kernel, dict(topk_ids_ptr=ids, counts_ptr="i32"),
                dict(BLOCK=triton_moe._ALIGN_BLOCK), num_warps=4)
        add_job(jobs, triton_moe._align_place_kernel,
                dict(topk_ids_ptr=ids, starts_ptr="i32", cursor_ptr="i32",
                     sorted_ids_ptr="i32"),
                dict(BLOCK=triton_moe._ALIGN_BLOCK), num_warps=4)
    for block_m, bins in ((16, 256), (64, 256), (64, 8)):
        add_job(jobs, triton_moe._align_offsets_kernel,
                dict(counts_ptr="i32", starts_ptr="i32", expert_ids_ptr="i32",
                     num_padded_ptr="i32", sorted_ids_ptr="i32"),
                dict(BLOCK_M=block_m, BINS=bins, FILL=triton_moe._ALIGN_FILL), num_warps=4)
    shared = compile_all(jobs, summary=False)
    over = []
    for (dt, fp8, block_m, block_n, block_k, warps, stages, gated), i in gemms:
        what = (f"{dt}{' fp8 experts' if fp8 else ''} tiles {block_m}x{block_n}x{block_k} "
                f"warps {warps} stages {stages} {'gated' if gated else 'down'}")
        print(what, f"shared {shared[i]} B")
        if shared[i] > H100_SHARED_BYTES:
            over.append(f"{what} needs {shared[i]} B of shared memory")
    if over:
        raise SystemExit(f"over an H100's {H100_SHARED_BYTES} B:\n" + "\n".join(over))
    print("compiled for sm_90")


if __name__ == "__main__":
    main()
