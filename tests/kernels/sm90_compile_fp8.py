"""Compile the block-scaled FP8 GEMM (kernels/triton_fp8.py) for an H100 (sm_90) without a
GPU (sm90_compile.py's helper): e4m3 dot products (DOT_FP8) at every BLOCK_M the launcher
picks, bf16 and fp16 activations, 128x128 scale blocks. Run with TRITON_INTERPRET unset."""

from __future__ import annotations

from sm90_compile import add_job, compile_all
from sm90_compile_moe import H100_SHARED_BYTES

from kernels import triton_fp8


def main() -> None:
    configs = [(dt, block_m) for dt in ("bf16", "fp16") for block_m in (16, 32, 64)]
    jobs: list[tuple] = []
    for dt, block_m in configs:
        add_job(jobs, triton_fp8._w8a8_block_kernel,
                dict(x_ptr=dt, w_ptr="fp8e4nv", ws_ptr="fp32", out_ptr=dt),
                dict(SCALE_BLOCK_N=128, BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128,
                     DOT_FP8=True), num_warps=4, num_stages=3)
    for (dt, block_m), shared in zip(configs, compile_all(jobs, summary=False)):
        if shared > H100_SHARED_BYTES:
            raise SystemExit(f"{dt} BLOCK_M {block_m} needs {shared} B of shared memory")
        print(dt, block_m, f"shared {shared} B")
    print("compiled for sm_90")


if __name__ == "__main__":
    main()
