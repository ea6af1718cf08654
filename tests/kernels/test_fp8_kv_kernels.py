"""FP8 KV cache in the Triton kernels (interpreter, CPU): the KV write and the prologue store
the torch twins' bytes (x / scale, saturated, rounded to nearest even), and paged attention
reads e4m3 with its scales in registers (decode, split-K, a prefill chunk over a cached
prefix, folded and unfolded tiles) to the torch twin's output within kernel_cases.TOL."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import INTERPRETER_ONLY, MIXED, TOL, make_paged_batch

import kernels
from kernels import reference
from kernels.triton_attention import paged_attention as triton_paged_attention

pytestmark = INTERPRETER_ONLY

F8 = torch.float8_e4m3fn


def _write_both(key, value, slots, k_scale, v_scale, op):
    out = []
    for backend in ("torch", "triton"):
        k_cache = torch.zeros(8, 4, key.shape[1], key.shape[2], dtype=F8)
        v_cache = torch.zeros_like(k_cache)
        op(key, value, k_cache, v_cache, slots, backend)
        out.append((k_cache.view(torch.uint8), v_cache.view(torch.uint8)))
    return out


def test_write_kv_stores_the_torch_bytes() -> None:
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(20, 2, 8, generator=gen) * 5
    # ties between e4m3 neighbours (17 -> 16, 19 -> 20), a carry into the next binade
    # (31.9 -> 32), saturation (+-1000 -> +-448), subnormals (3e-3 -> 2^-8, -2e-4 -> -0)
    key[0, 0] = torch.tensor([17.0, 19.0, 31.9, -1000.0, 1000.0, 3e-3, -2e-4, 0.0])
    value = torch.randn(20, 2, 8, generator=gen)
    slots = torch.randperm(32, generator=gen)[:20]
    slots[3] = -1
    key[:, 1] *= 40  # head 1 over a scale 40x head 0's
    value[:, 0] *= 0.1
    ks, vs = torch.tensor([1.0, 40.0]), torch.tensor([0.005, 0.05])
    (want_k, want_v), (got_k, got_v) = _write_both(
        key, value, slots, ks, vs, lambda k, v, kc, vc, s, b: kernels.write_kv(
            k, v, kc, vc, s, backend=b, k_scale=ks, v_scale=vs))
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    first = want_k.view(F8).view(-1, 2, 8)[slots[0], 0].float()
    assert first.tolist() == [16.0, 20.0, 32.0, -448.0, 448.0, 2 ** -8, -0.0, 0.0]


def test_prologue_stores_the_torch_bytes() -> None:
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, (4 + 2 * 2) * 16, generator=gen)
    w_q, w_k = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    positions = torch.tensor([0, 3, 9, 27, 5, 63])
    cos_sin = kernels.compute_cos_sin_cache(16, 64, 10000.0)
    qkv[:, (4 + 2) * 16:(4 + 2) * 16 + 16] *= 30  # V head 0 30x head 1, over its own scale
    ks, vs = torch.tensor([0.02, 0.002]), torch.tensor([0.3, 0.01])
    outs = []
    for backend in ("torch", "triton"):
        x = qkv.clone()
        k_cache = torch.zeros(8, 4, 2, 16, dtype=F8)
        v_cache = torch.zeros_like(k_cache)
        q, k, _ = kernels.qk_norm_rope_write_kv(x, 4, 2, w_q, w_k, 1e-6, positions, cos_sin,
                                                k_cache, v_cache, torch.arange(6) * 5,
                                                backend=backend, k_scale=ks, v_scale=vs)
        outs.append((k.clone(), k_cache, v_cache))
    (k_ref, kc_ref, vc_ref), (k_tri, kc_tri, vc_tri) = outs
    torch.testing.assert_close(k_tri, k_ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(vc_tri.view(torch.uint8), vc_ref.view(torch.uint8))
    # K passes through the rotary first, whose float32 rounding may differ in the last bit:
    # at most one e4m3 step (1/8 relative) apart, and equal almost everywhere.
    a, b = kc_tri.float(), kc_ref.float()
    assert bool(((a - b).abs() <= b.abs() / 8 + 2 ** -9).all())
    assert (a != b).float().mean() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("lens", "options"), [
    (MIXED, {}),  # decodes and prefill chunks over cached prefixes, one launch
    ([(1, 9), (1, 70), (1, 33)], {"num_segments": 4}),  # split-K decode
    ([(1, 9), (130, 150), (20, 61)], {}),  # a long chunk: unfolded tiles beside folded ones
])
def test_attention_reads_fp8_like_the_torch_twin(dtype: torch.dtype, lens, options) -> None:
    b = make_paged_batch(lens, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                         dtype=torch.float32, device="cpu", seed=9)
    # per KV head, 10-20x apart (the values' magnitudes are left alone: fp16 dots over K/V 20x
    # larger round past TOL, which is about the kernels, not the scales)
    ks, vs = torch.tensor([0.01, 0.1]), torch.tensor([0.08, 0.004])
    k8 = reference.quantize_kv(b.k_cache, F8, ks)  # (NaN poison stays NaN)
    v8 = reference.quantize_kv(b.v_cache, F8, vs)
    q = b.q.to(dtype)
    args = (q, k8, v8, b.block_tables, b.query_start_loc, b.seq_lens, b.scale)
    want = kernels.paged_attention(*args, b.max_query_len, b.max_seq_len, backend="torch",
                                   k_scale=ks, v_scale=vs)
    # this step's rows, which an FP8 cache ignores: it reads every key from the cache
    rows = torch.full((q.shape[0], 2, 16), float("nan"), dtype=dtype)
    got = triton_paged_attention(*args, b.max_query_len, b.max_seq_len, rows, rows,
                                 k_scale=ks, v_scale=vs, **options)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
