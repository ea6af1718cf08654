"""Compile the sampling kernels for an H100 (sm_90) without a GPU (see sm90_compile.py, whose
helper this uses): every logits dtype, with and without temperature, and the `num_chunks == 1`
specialisation Triton applies to a one-chunk vocabulary. Run with TRITON_INTERPRET unset."""

from __future__ import annotations

from sm90_compile import add_job, compile_all

from kernels import triton_sampling
from kernels.reference import SAMPLE_CHUNK


def main() -> None:
    jobs: list[tuple] = []
    for dt in ("bf16", "fp16", "fp32"):
        for has_t in (True, False):
            for extra in ({}, {"num_chunks": 1}):
                add_job(jobs, triton_sampling._chunk_stats_kernel,
                        dict(logits_ptr=dt, temperature_ptr="fp32", cmax_ptr="fp32",
                             csum_ptr="fp32"),
                        dict(HAS_TEMPERATURE=has_t, CHUNK=SAMPLE_CHUNK, CHUNKS_PER_PROG=32,
                             LIBDEVICE_EXP=True, **extra), num_warps=4)
                add_job(jobs, triton_sampling._pick_kernel,
                        dict(logits_ptr=dt, temperature_ptr="fp32", key_ptr="i64",
                             counter_ptr="i64", cmax_ptr="fp32", csum_ptr="fp32",
                             out_ptr="i64"),
                        dict(HAS_TEMPERATURE=has_t, CHUNK=SAMPLE_CHUNK,
                             BLOCK=triton_sampling._PICK_BLOCK, LIBDEVICE_EXP=True,
                             **extra), num_warps=4)
    compile_all(jobs)


if __name__ == "__main__":
    main()
