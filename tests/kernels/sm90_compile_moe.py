"""Compile the fused-MoE kernels for an H100 (sm_90) without a GPU (see sm90_compile.py,
whose helper this uses): the three alignment kernels, and the GEMM at every row of
`_TILE_TABLE`, gate+up (GATED, rows per token) and down (routing weights applied), in bf16
(the GPU default) with bf16 and block-scaled FP8 experts (128x128 blocks, W8A8: e4m3 dot
products, BLOCK_K 128), and fp32 at one tile. Run with TRITON_INTERPRET unset."""

from __future__ import annotations

from sm90_compile import add_job, compile_all

from kernels import triton_moe

# An H100's shared memory per block (227 KiB): a launch above it fails, compiling does not.
H100_SHARED_BYTES = 232448


def main() -> None:
    """Every configuration compiles in compile_all's pool (LLVM and ptxas are single-threaded);
    each GEMM tile's shared memory is checked once all have compiled."""
    configs = [("bf16", fp8, row[1:]) for row in triton_moe._TILE_TABLE for fp8 in (False, True)]
    configs.append(("fp32", False, (16, 64, 32, 1, 4, 2)))
    jobs: list[tuple] = []
    gemms: list[tuple] = []  # (what, job index) of each GEMM configuration
    for dt, fp8, (block_m, block_n, block_k, group_m, warps, stages) in configs:
        block_k = 128 if fp8 else block_k  # FP8: the K loop steps one scale block
        for gated in (True, False):
            gemms.append(((dt, fp8, block_m, block_n, block_k, stages, gated), len(jobs)))
            add_job(jobs, triton_moe._moe_gemm_kernel,
                    dict(a_ptr=dt, b_ptr="fp8e4nv" if fp8 else dt, c_ptr=dt, weights_ptr="fp32",
                         sorted_ids_ptr="i32", expert_ids_ptr="i32", num_padded_ptr="i32",
                         bs_ptr="fp32" if fp8 else dt),
                    dict(TOP_K=8 if gated else 1, A_PER_TOKEN=gated, GATED=gated,
                         MUL_WEIGHT=not gated, BLOCK_M=block_m, BLOCK_N=block_n,
                         BLOCK_K=block_k,
                         GROUP_M=group_m, DOT_PRECISION="ieee" if dt == "fp32" else "tf32",
                         FP8_W=fp8, SCALE_N=128 if fp8 else 1, DOT_FP8=fp8),
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
    for (dt, fp8, block_m, block_n, block_k, stages, gated), i in gemms:
        if shared[i] > H100_SHARED_BYTES:
            raise SystemExit(f"{dt} tiles {block_m}x{block_n}x{block_k} stages {stages} "
                             f"gated={gated} fp8={fp8} need {shared[i]} B of shared memory")
        print(dt, "fp8 experts" if fp8 else "", (block_m, block_n, block_k, stages),
              "gated" if gated else "down", f"shared {shared[i]} B")
    print("compiled for sm_90")


if __name__ == "__main__":
    main()
