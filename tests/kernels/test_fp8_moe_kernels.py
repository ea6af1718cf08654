"""Block-scaled FP8 experts in the fused MoE kernels, W8A8: the torch twin is, token by token,
the experts dequantized with each GEMM's input quantized per row and `bk` group and
dequantized again; the Triton kernel (interpreter, CPU), which quantizes each A tile on the
fly and scales the e4m3 products in registers, gives the twin's output, expert parallelism's
remote pairs and B tiles wider than a scale block included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import INTERPRETER_ONLY
from test_moe_kernels import make_case

from kernels import ops
from kernels.fp8_reference import (
    dequantize_weight_blocks,
    fake_quantize_act_groups,
    quantize_weight_blocks,
)


def _quantized(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [quantize_weight_blocks(e, block) for e in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _fp8_case(block: tuple[int, int], remote: bool = False, seed: int = 0, hidden: int = 64):
    x, w13, w2, weights, ids = make_case(9, 4, 2, hidden=hidden, inter=32, seed=seed,
                                         remote=remote)
    (q13, s13), (q2, s2) = _quantized(w13, block), _quantized(w2, block)
    return x, (q13, s13), (q2, s2), weights, ids


def _token_by_token(x, w13, w2, weights, ids, group: int) -> torch.Tensor:
    """Each (token, expert) pair on its own, W8A8 on float (dequantized) experts."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            if e < 0:
                continue
            g_u = fake_quantize_act_groups(x[t:t + 1], group) @ w13[e].T
            h = F.silu(g_u[:, :inter]) * g_u[:, inter:]
            out[t] += weights[t, j] * (fake_quantize_act_groups(h, group) @ w2[e].T)[0]
    return out


@pytest.mark.parametrize("remote", [False, True], ids=["local", "ep"])
def test_twin_is_w8a8_on_the_dequantized_experts(remote: bool) -> None:
    block = (16, 32)
    x, (q13, s13), (q2, s2), weights, ids = _fp8_case(block, remote)
    d13, d2 = dequantize_weight_blocks(q13, s13, block), dequantize_weight_blocks(q2, s2, block)
    got = ops.fused_moe(x, q13, q2, weights, ids, backend="torch", w13_scale=s13, w2_scale=s2,
                        block=block)
    want = _token_by_token(x, d13, d2, weights, ids, block[1])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the activations really are quantized: W8A16 (float inputs) is elsewhere
    w8a16 = ops.fused_moe(x, d13, d2, weights, ids, backend="torch")
    assert (got - w8a16).abs().max() > 1e-3


@INTERPRETER_ONLY
@pytest.mark.parametrize("block", [(16, 16), (32, 32), (16, 32)])
@pytest.mark.parametrize("remote", [False, True], ids=["local", "ep"])
def test_triton_fp8_experts_match_the_twin(block: tuple[int, int], remote: bool) -> None:
    x, (q13, s13), (q2, s2), weights, ids = _fp8_case(block, remote, seed=7)
    args = dict(w13_scale=s13, w2_scale=s2, block=block)
    want = ops.fused_moe(x, q13, q2, weights, ids, backend="torch", **args)
    got = ops.fused_moe(x, q13, q2, weights, ids, backend="triton", **args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@INTERPRETER_ONLY
def test_triton_partial_hidden_blocks_match_the_twin() -> None:
    """A hidden size of 72 (2.25 blocks of 32 columns, 4.5 of 16 rows): w13's last K block
    and w2's last N block are partial."""
    block = (16, 32)
    x, (q13, s13), (q2, s2), weights, ids = _fp8_case(block, seed=3, hidden=72)
    assert s13.shape == (4, 4, 3) and s2.shape == (4, 5, 1)
    args = dict(w13_scale=s13, w2_scale=s2, block=block)
    want = ops.fused_moe(x, q13, q2, weights, ids, backend="torch", **args)
    got = ops.fused_moe(x, q13, q2, weights, ids, backend="triton", **args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@INTERPRETER_ONLY
def test_triton_tiles_span_scale_blocks_in_n_and_step_one_in_k() -> None:
    """A 64x64 tile over 16x16 blocks: its columns read four blocks' scales, and its K step
    is cut to one block (one activation group)."""
    from kernels.triton_moe import fused_moe as triton_fused_moe

    block = (16, 16)
    x, (q13, s13), (q2, s2), weights, ids = _fp8_case(block, seed=9)
    want = ops.fused_moe(x, q13, q2, weights, ids, backend="torch", w13_scale=s13,
                         w2_scale=s2, block=block)
    got = triton_fused_moe(x, q13, q2, weights, ids, tiles=(16, 64, 64, 2, 4, 1),
                           w13_scale=s13, w2_scale=s2, block=block)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp8_experts_without_their_scales_are_refused() -> None:
    x, (q13, s13), (q2, s2), weights, ids = _fp8_case((16, 16))
    with pytest.raises(ValueError, match="FP8 .* experts need w13_scale, w2_scale and block"):
        ops.fused_moe(x, q13, q2, weights, ids, backend="torch")
    with pytest.raises(ValueError, match=r"w2 must be float8_e4m3fn with float32 scales "
                                         r"\(4, 4, 2\) for block \(16, 16\)"):
        ops.fused_moe(x, q13, q2, weights, ids, backend="torch", w13_scale=s13,
                      w2_scale=s2[:, :2], block=(16, 16))
    with pytest.raises(ValueError, match="powers of two >= 16; got \\(12, 16\\)"):
        ops.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, block=(12, 16))
