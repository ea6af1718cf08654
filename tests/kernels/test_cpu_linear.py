"""kernels/cpu_linear.py: which weights are packed for oneDNN, and the packed product's values.

The oracle is the float64 product of the same bf16 values; a bf16 result may differ from it
by the rounding of the output to bf16 (2^-8 relative) plus the float32 accumulation's error,
which is what `F.linear` in bf16 is held to as well.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels

BF16 = torch.bfloat16


def _close_to_exact(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = F.linear(x.double(), w.double())
    bound = exact.abs() * 2.0 ** -8 + 1e-4 * (x.double().abs() @ w.double().abs().T)
    assert got.dtype == x.dtype and got.shape == exact.shape
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_bf16_cpu_weight_is_packed_small_fp32_is_not() -> None:
    w = torch.randn(96, 64)
    assert kernels.pack_linear_weight(w) is None  # a projection in fp32 stays on MKL's sgemm
    packed = kernels.pack_linear_weight(w.to(BF16))
    assert packed is not None and packed.is_mkldnn and packed.shape == (96, 64)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_fp32_lm_head_sized_weight_is_packed_within_summation_order_error(rows: int) -> None:
    """qwen3-tiny's LM head shape, FP32_PACK_MIN_NUMEL and up. The same fp32 products summed
    in oneDNN's order: each output within n * 2^-24 * sum|x_k w_k| (n = 128 terms) of the exact
    sum, the worst case of any summation order, which MKL's sgemm meets too."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(151936, 128, generator=g) * 0.1
    assert w.numel() >= kernels.cpu_linear.FP32_PACK_MIN_NUMEL
    assert kernels.pack_linear_weight(w[:-1]) is not None
    assert kernels.pack_linear_weight(w[:(kernels.cpu_linear.FP32_PACK_MIN_NUMEL // 128) - 1]) is None
    packed = kernels.pack_linear_weight(w)
    assert packed is not None and packed.is_mkldnn and packed.dtype == torch.float32
    x = torch.randn(rows, 128, generator=g)
    got = kernels.linear(x, w, packed)
    exact = F.linear(x.double(), w.double())
    bound = 128 * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    assert got.dtype == torch.float32 and got.shape == (rows, 151936)
    assert bool(((got.double() - exact).abs() <= bound).all())
    assert bool(((F.linear(x, w).double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("rows", [0, 1, 7, 16, 64, 257])
def test_packed_bf16_product_within_bf16_rounding(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(384, 128, generator=g) * 0.05).to(BF16)
    x = torch.randn(rows, 128, generator=g).to(BF16)
    packed = kernels.pack_linear_weight(w)
    got = kernels.linear(x, w, packed)
    _close_to_exact(got, x, w)
    _close_to_exact(F.linear(x, w), x, w)  # the unpacked path meets the same bound


def test_packed_product_keeps_leading_dims_and_reads_strided_input() -> None:
    w = torch.randn(48, 32).to(BF16)
    packed = kernels.pack_linear_weight(w)
    x3 = torch.randn(2, 5, 32).to(BF16)
    assert torch.equal(kernels.linear(x3, w, packed), kernels.linear(x3.reshape(10, 32), w, packed)
                       .reshape(2, 5, 48))
    wide = torch.randn(6, 64).to(BF16)
    _close_to_exact(kernels.linear(wide[:, :32], w, packed), wide[:, :32], w)


def test_unpacked_linear_is_f_linear() -> None:
    w, x = torch.randn(24, 16), torch.randn(3, 16)
    assert torch.equal(kernels.linear(x, w), F.linear(x, w))


def test_activation_dtype_other_than_the_packed_weight_is_refused() -> None:
    w = torch.randn(24, 16).to(BF16)
    with pytest.raises(ValueError, match="cast the input"):
        kernels.linear(torch.randn(3, 16), w, kernels.pack_linear_weight(w))


def _fp32_bound(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product and the worst case of any fp32 summation order over `in` terms."""
    return (F.linear(x.double(), w.double()),
            w.shape[1] * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T))


@pytest.mark.parametrize("vocab", [151936, 75968])  # qwen3-tiny's head; a tp-2 rank's half
def test_narrow_fp32_head_keeps_a_transposed_copy_for_one_row(vocab: int) -> None:
    """One row goes through the `[blocks, in, cols]` copy (each block's own product, bit for
    bit, on 1 or 2 threads), more rows through the packed GEMM; both within summation-order
    error."""
    g = torch.Generator().manual_seed(vocab)
    w = torch.randn(vocab, 128, generator=g) * 0.1
    packed, t = kernels.pack_linear_weight(w), kernels.transpose_linear_weight(w)
    assert packed is not None and t is not None
    blocks = kernels.cpu_linear.T_BLOCKS
    cols = vocab // blocks
    assert t.shape == (blocks, 128, cols) and t.is_contiguous()
    assert torch.equal(t.permute(1, 0, 2).reshape(128, vocab), w.T)
    assert t.data_ptr() != w.data_ptr()
    one, rows = torch.randn(1, 128, generator=g), torch.randn(3, 128, generator=g)
    got = kernels.linear(one, w, packed, t)
    for b in range(blocks):
        assert torch.equal(got[:, b * cols:(b + 1) * cols], torch.mm(one, t[b]))
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(kernels.linear(one, w, packed, t), got)
    finally:
        torch.set_num_threads(saved)
    exact, bound = _fp32_bound(one, w)
    assert got.shape == (1, vocab) and bool(((got.double() - exact).abs() <= bound).all())
    many = kernels.linear(rows, w, packed, t)
    assert torch.equal(many, kernels.linear(rows, w, packed))  # (the packed GEMM's)
    exact, bound = _fp32_bound(rows, w)
    assert bool(((many.double() - exact).abs() <= bound).all())
    assert kernels.linear(one.reshape(1, 1, 128), w, packed, t).shape == (1, 1, vocab)


def test_one_row_head_with_padded_blocks() -> None:
    """A vocabulary that T_BLOCKS does not divide: the last block's padding columns are zeros
    and the product has exactly `out` columns, each within summation-order error."""
    blocks = kernels.cpu_linear.T_BLOCKS
    vocab = (1 << 23) // 128 + blocks + 1  # packed (>= FP32_PACK_MIN_NUMEL), not divisible
    assert vocab % blocks
    g = torch.Generator().manual_seed(7)
    w = torch.randn(vocab, 128, generator=g)
    t = kernels.transpose_linear_weight(w)
    cols = -(-vocab // blocks)
    assert t is not None and t.shape == (blocks, 128, cols)
    pad = blocks * cols - vocab
    assert pad > 0 and not t[-1, :, cols - pad:].any()
    one = torch.randn(1, 128, generator=g)
    got = kernels.linear(one, w, kernels.pack_linear_weight(w), t)
    assert got.shape == (1, vocab) and got.stride(1) == 1
    exact, bound = _fp32_bound(one, w)
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_only_narrow_packed_fp32_weights_are_transposed() -> None:
    """bf16 (its packed GEMM is the faster at one row), an fp32 weight too small to pack, and
    one over FP32_T_MAX_BYTES (a wide model's head: its copy would cost hundreds of MB) keep no
    transposed copy."""
    limit = kernels.cpu_linear.FP32_T_MAX_BYTES
    assert kernels.transpose_linear_weight(torch.randn(151936, 128).to(BF16)) is None
    assert kernels.transpose_linear_weight(torch.randn(96, 64)) is None
    wide = torch.empty(limit // (4 * 128) + 1, 128)
    assert kernels.pack_linear_weight(wide) is not None
    assert kernels.transpose_linear_weight(wide) is None
    assert kernels.transpose_linear_weight(wide[:limit // (4 * 128)]) is not None
