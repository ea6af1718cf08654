"""Compile every Triton kernel for an H100 (sm_90) without a GPU: `python sm90_compile.py`.

Run with TRITON_INTERPRET unset (the interpreter never builds IR). It shows the kernels pass
Triton's front end, layout passes, LLVM and ptxas for the configurations ops.py launches: all
kernels in bf16, attention decode/prefill tiles (folded and unfolded) also in fp16/fp32, GQA
1/2/8, split-K on and off, chunk K/V on and off, the `== 1` integer specialisations Triton
applies to runtime arguments, and the FP8 KV cache (e4m3 caches with bf16 activations: the KV
write, the prologue, decode with split-K, folded and unfolded prefill tiles).
"""

from __future__ import annotations

import multiprocessing
import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import triton_attention, triton_fused, triton_kv

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, ptrs: dict[str, str], constexprs: dict, floats: tuple[str, ...] = (),
                   aligned: bool = True, **options: int):
    """Compile `fn` for TARGET. `aligned`: pointers and `stride*` arguments carry the
    divisible-by-16 specialisation a launch on aligned tensors gets (what enables 16-byte
    vector loads and cp.async pipelining), as real launches of ops.py's tensors do, but for
    those the kernel never specialises (`do_not_specialize`, `do_not_specialize_on_alignment`)."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ptrs:
            signature[name] = "*" + ptrs[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    never = {*fn.do_not_specialize, *fn.do_not_specialize_on_alignment}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if aligned and (name in ptrs or name.startswith("stride")) and name not in never}
    src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=TARGET, options=options)


def jobs() -> list[tuple]:
    """Every (kernel, pointer types, constexprs, floats, aligned, options) to compile."""
    out: list[tuple] = []
    for dt in ("bf16", "fp16", "fp32"):
        precision = "ieee" if dt == "fp32" else "tf32"
        # (BLOCK_M, GROUP, FOLD, segments, chunk K/V, warps, stages, integer specialisations):
        # decode, short-chunk (folded) and long-chunk (unfolded, Hopper-sized) prefill tiles in
        # every dtype; in bf16 (the GPU default) also GQA 1 and 8, split-K and no chunk K/V.
        variants = [(16, 2, 2, 16, True, 4, 2, {"num_seqs": 1, "block_size": 1, "q_len_lo": 1}),
                    (64, 2, 2, 1, True, 4, 3, {}), (128, 2, 1, 1, True, 8, 3, {})]
        if dt == "bf16":
            variants += [(16, 2, 2, 1, False, 4, 2, {}), (16, 8, 8, 4, False, 4, 2, {}),
                         (64, 1, 1, 2, False, 4, 3, {}), (128, 8, 1, 1, False, 8, 3, {}),
                         (128, 2, 1, 1, True, 8, 4, {})]
        for i, (block_m, group, fold, segments, chunk_kv, warps, stages, extra) in \
                enumerate(variants):
            part = "fp32" if segments > 1 else dt
            # FP8 caches (bf16 activations): the decode, folded and unfolded prefill tiles
            for fp8 in (False, True) if dt == "bf16" and i < 3 else (False,):
                cache = "fp8e4nv" if fp8 else dt
                ptrs = dict(out_ptr=dt, q_ptr=dt, key_ptr=dt, value_ptr=dt, k_cache_ptr=cache,
                            v_cache_ptr=cache, k_scale_ptr="fp32", v_scale_ptr="fp32",
                            block_tables_ptr="i32", query_start_loc_ptr="i32",
                            seq_lens_ptr="i32", part_acc_ptr=part, part_max_ptr=part,
                            part_sum_ptr=part)
                add_job(out, triton_attention._paged_attention_kernel, ptrs,
                        dict(GROUP=group, FOLD=fold, HEAD_DIM=128, HEAD_DIM_PAD=128,
                             BLOCK_M=block_m, BLOCK_Q=block_m // fold, TILE_N=64,
                             NUM_SEGMENTS=segments, HAS_CHUNK_KV=chunk_kv and not fp8,
                             DOT_PRECISION=precision, FP8=fp8, **extra),
                        floats=("scale_log2",), aligned=i > 0, num_warps=warps,
                        num_stages=stages)
        if dt != "bf16":
            continue
        add_job(out, triton_attention._merge_segments_kernel,
                dict(out_ptr=dt, part_acc_ptr="fp32", part_max_ptr="fp32",
                     part_sum_ptr="fp32"),
                dict(HEAD_DIM=128, HEAD_DIM_PAD=128, NUM_SEGMENTS=16), num_warps=4)
        for fp8 in (False, True):
            cache = "fp8e4nv" if fp8 else dt
            add_job(out, triton_kv._write_kv_kernel,
                    dict(key_ptr=dt, value_ptr=dt, k_cache_ptr=cache, v_cache_ptr=cache,
                         k_scale_ptr="fp32", v_scale_ptr="fp32", slot_mapping_ptr="i64"),
                    dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_HD=1024, FP8=fp8), num_warps=4)
        for residual in (False, True):
            add_job(out, triton_fused._rms_norm_kernel,
                    dict(out_ptr=dt, x_ptr=dt, residual_ptr=dt, residual_out_ptr=dt,
                         weight_ptr=dt),
                    dict(HAS_RESIDUAL=residual, BLOCK=1024), floats=("eps",), num_warps=4)
        # the prologue (into a bf16 and an FP8 cache); plain rotary
        for norm, write, fp8 in ((True, True, False), (True, True, True), (False, False, False)):
            cache = "fp8e4nv" if fp8 else dt
            add_job(out, triton_fused._qk_norm_rope_kernel,
                    dict(positions_ptr="i64", q_ptr=dt, k_ptr=dt, v_ptr=dt,
                         q_weight_ptr=dt, k_weight_ptr=dt, cos_sin_ptr="fp32",
                         k_cache_ptr=cache, v_cache_ptr=cache, k_scale_ptr="fp32",
                         v_scale_ptr="fp32", slot_mapping_ptr="i64"),
                    dict(HALF=64, BLOCK_HALF=64, BLOCK_HQ=16, BLOCK_HK=8, NORM=norm,
                         WRITE_KV=write, FP8=fp8), floats=("eps",), num_warps=4)
        add_job(out, triton_fused._silu_and_mul_kernel, dict(out_ptr=dt, x_ptr=dt),
                dict(BLOCK=1024), num_warps=4)
    return out


def add_job(out: list[tuple], fn, ptrs: dict[str, str], constexprs: dict,
         floats: tuple[str, ...] = (), aligned: bool = True, **options: int) -> None:
    out.append((fn, ptrs, constexprs, floats, aligned, options))


_JOBS: list[tuple] = []


def _compile(i: int) -> tuple[int, int]:
    fn, ptrs, constexprs, floats, aligned, options = _JOBS[i]
    compiled = compile_kernel(fn, ptrs, constexprs, floats, aligned, **options)
    return i, compiled.metadata.shared


def compile_all(jobs: list[tuple], summary: bool = True) -> list[int]:
    """Compile every job (add_job's tuples), each in a forked process, as many at once as
    there are CPUs: LLVM and ptxas are single-threaded. Put the longest jobs first. Returns
    each job's shared memory in bytes, in the jobs' order; with `summary`, prints the line
    that says all compiled."""
    _JOBS[:] = jobs
    shared = [0] * len(_JOBS)
    workers = min(len(_JOBS), os.cpu_count() or 1)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for i, nbytes in pool.imap_unordered(_compile, range(len(_JOBS))):
            shared[i] = nbytes
    if summary:
        print(f"{len(_JOBS)} configurations compiled for sm_90")
    return shared


def main() -> None:
    compile_all(jobs())


if __name__ == "__main__":
    main()
