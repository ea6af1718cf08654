"""The FP8 cache's quantization (`triton_kv.to_cache`) divides by the scale with IEEE rounding
on real hardware, as the torch twin does.

A plain `/` on float32 compiles to PTX's approximate `div.full.f32` on CUDA, while Triton's
interpreter divides exactly: on an H100 (2026-11-27) the Triton KV write then stored FP8 values
one e4m3 step away from the twin's where `x / scale` lay near a rounding midpoint
(`test_fp8_kernels_gpu.py::test_per_head_scales_in_the_bf16_write_and_prologue`). These compile
the kernels that quantize for sm_90 without a GPU (tests/kernels/sm90_compile.py) and read the
PTX: IEEE `div.rn.f32`, never `div.full.f32`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import re, sys
sys.path.insert(0, "tests/kernels")
from sm90_compile import compile_kernel
from kernels import triton_fp8, triton_fused, triton_kv
kv = compile_kernel(triton_kv._write_kv_kernel,
                    dict(key_ptr="bf16", value_ptr="bf16", k_cache_ptr="fp8e4nv",
                         v_cache_ptr="fp8e4nv", k_scale_ptr="fp32", v_scale_ptr="fp32",
                         slot_mapping_ptr="i64"),
                    dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_HD=1024, FP8=True), num_warps=4)
prologue = compile_kernel(triton_fused._qk_norm_rope_kernel,
                          dict(positions_ptr="i64", q_ptr="bf16", k_ptr="bf16", v_ptr="bf16",
                               q_weight_ptr="bf16", k_weight_ptr="bf16", cos_sin_ptr="fp32",
                               k_cache_ptr="fp8e4nv", v_cache_ptr="fp8e4nv",
                               k_scale_ptr="fp32", v_scale_ptr="fp32",
                               slot_mapping_ptr="i64"),
                          dict(HALF=64, BLOCK_HALF=64, BLOCK_HQ=16, BLOCK_HK=8, NORM=True,
                               WRITE_KV=True, FP8=True), floats=("eps",), num_warps=4)
gemm = compile_kernel(triton_fp8._w8a8_block_kernel,
                      dict(x_ptr="bf16", w_ptr="fp8e4nv", ws_ptr="fp32", out_ptr="bf16"),
                      dict(SCALE_BLOCK_N=128, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128,
                           DOT_FP8=True), num_warps=4, num_stages=3)
for name, k in (("kv write", kv), ("prologue", prologue), ("w8a8 gemm", gemm)):
    print(name, sorted(set(re.findall(r"\bdiv\.[a-z]+\.f32\b", k.asm["ptx"]))))
"""


@pytest.mark.slow
def test_fp8_quantization_divides_with_ieee_rounding_on_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = dict(line.split(" [", 1) for line in result.stdout.strip().splitlines()
                 if " [" in line)
    assert set(lines) == {"kv write", "prologue", "w8a8 gemm"}, result.stdout
    for name, found in lines.items():
        divisions = re.findall(r"div\.[a-z]+\.f32", found)
        assert "div.rn.f32" in divisions, (name, found)
        assert "div.full.f32" not in divisions, (name, found)
