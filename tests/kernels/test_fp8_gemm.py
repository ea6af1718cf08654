"""Block-scaled FP8 GEMM: the format round-trips within e4m3's error, the torch twin is the
W8A8 arithmetic (per-token, per-group activation scales), and the Triton kernel (interpreter,
CPU) gives the twin's output at small shapes, edge tiles and edge blocks included."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import INTERPRETER_ONLY, run_sm90_compile

import kernels
from kernels import fp8_reference

# e4m3 keeps 3 mantissa bits: a value rounds to within 2^-4 of itself, relative.
E4M3_REL = 2.0 ** -4


def test_weight_blocks_round_trip_within_e4m3_error() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 160, generator=gen)
    w[:64, :32] *= 100  # one block far larger than the others keeps its own scale
    q, scale = fp8_reference.quantize_weight_blocks(w, (64, 32))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (4, 5)
    assert scale[0, 0] == pytest.approx(w[:64, :32].abs().max().item() / 448)
    back = fp8_reference.dequantize_weight_blocks(q, scale, (64, 32))
    bound = (E4M3_REL * fp8_reference._expand(scale, (64, 32), (200, 160)) * 448)
    assert ((back - w).abs() <= bound).all()
    assert (back - w).abs().max() > 0  # it really is quantized


def test_twin_quantizes_activations_per_token_group() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=gen)
    x[1, 32:] *= 1000  # row 1's second group: its own scale, the first group unharmed
    w = torch.randn(16, 64, generator=gen)
    q, scale = fp8_reference.quantize_weight_blocks(w, (16, 32))
    xq, xs = fp8_reference.quantize_act_groups(x, 32)
    assert xs.shape == (3, 2) and xs[1, 1] > 100 * xs[1, 0]
    want = (xq.float() * xs.repeat_interleave(32, 1)) @ (
        fp8_reference.dequantize_weight_blocks(q, scale, (16, 32)).T)
    got = kernels.fp8_block_linear(x, q, scale, (16, 32), backend="torch")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    exact = x @ w.T
    rel = (got - exact).norm() / exact.norm()
    assert 0 < rel < 2 * E4M3_REL


@INTERPRETER_ONLY
@pytest.mark.parametrize("m,n,k,block", [(5, 48, 64, (16, 32)), (33, 40, 96, (32, 32)),
                                         (17, 128, 128, (128, 128)),
                                         (7, 40, 80, (16, 32))])  # partial last blocks
def test_triton_gemm_matches_the_twin(m: int, n: int, k: int, block: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    x[0] = 0.0  # a row of zeros: its scale must not divide by zero
    w = torch.randn(n, k, generator=gen) * 0.1
    q, scale = fp8_reference.quantize_weight_blocks(w, block)
    want = kernels.fp8_block_linear(x, q, scale, block, backend="torch")
    got = kernels.fp8_block_linear(x, q, scale, block, backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got[0].abs().max() == 0


def test_bad_scales_are_refused_with_the_expected_shape() -> None:
    q, scale = fp8_reference.quantize_weight_blocks(torch.randn(64, 64), (32, 32))
    with pytest.raises(ValueError, match=r"float32 \(2, 2\) for block \(32, 32\)"):
        kernels.fp8_block_linear(torch.randn(2, 64), q, scale[:1], (32, 32), backend="torch")
    with pytest.raises(ValueError, match="x must be"):
        kernels.fp8_block_linear(torch.randn(2, 32), q, scale, (32, 32), backend="torch")


@pytest.mark.slow
def test_kernel_compiles_for_h100(tmp_path) -> None:
    """Without a GPU, the e4m3 GEMM passes Triton, LLVM and ptxas for sm_90 at every BLOCK_M
    the launcher picks and fits an H100's shared memory."""
    run_sm90_compile("sm90_compile_fp8.py", tmp_path)
