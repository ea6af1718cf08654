"""The CPU small ops (kernels/cpu_fused.py) against their plain-torch twins: bit-identical
outputs, caches and residuals, in every dtype a model runs in, and the step cache's reuse."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_fused, reference

F8 = reference.FP8_KV_DTYPE
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (Hq, Hkv, D): Qwen3-0.6B's heads, qwen3-tiny's, one KV head per query head
HEADS = [(16, 8, 128), (4, 2, 32), (2, 2, 16)]


def _prologue_inputs(dtype: torch.dtype, heads: tuple[int, int, int], tokens: int, seed: int):  # noqa: ANN202
    num_q, num_kv, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, generator=gen) * 3).to(dtype)
    w_q = (torch.rand(head_dim, generator=gen) + 0.5).to(dtype)
    w_k = (torch.rand(head_dim, generator=gen) - 0.5).to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    cos_sin = kernels.compute_cos_sin_cache(head_dim, 512, 1_000_000.0)
    return qkv, w_q, w_k, positions, cos_sin


def _prologue(impl, qkv, heads, w_q, w_k, positions, cos_sin, slots, cache_dtype,  # noqa: ANN001, ANN202
              scales=(None, None), **step):
    num_q, num_kv, head_dim = heads
    k_cache = torch.full((8, 4, num_kv, head_dim), float("nan")).to(cache_dtype)
    v_cache = k_cache.clone()
    x = qkv.clone()
    q, k, v = impl.qk_norm_rope_write_kv(x, num_q, num_kv, w_q, w_k, 1e-6, positions, cos_sin,
                                         k_cache, v_cache, slots, *scales, **step)
    assert q.data_ptr() == x.data_ptr()  # views of qkv, normed and rotated in place
    return x, k_cache, v_cache


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (NaN in the untouched cache rows included)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("skip", [False, True], ids=["all-slots", "with-minus-one"])
def test_prologue_is_bit_identical_to_the_twin(dtype: torch.dtype, heads: tuple[int, int, int],
                                               skip: bool) -> None:
    qkv, w_q, w_k, positions, cos_sin = _prologue_inputs(dtype, heads, 7, seed=3)
    slots = torch.tensor([5, 0, 31, 12, 7, 20, 3])
    if skip:
        slots[[1, 4]] = -1  # (padding rows: not written)
    want = _prologue(reference, qkv, heads, w_q, w_k, positions, cos_sin, slots, dtype)
    got = _prologue(cpu_fused, qkv, heads, w_q, w_k, positions, cos_sin, slots, dtype,
                    step_cache={})
    assert all(_same_bytes(g, w) for g, w in zip(got, want))


def test_prologue_into_an_fp8_cache_stores_the_twins_bytes() -> None:
    heads = (4, 2, 16)
    qkv, w_q, w_k, positions, cos_sin = _prologue_inputs(torch.float32, heads, 6, seed=1)
    scales = (torch.tensor([0.02, 0.002]), torch.tensor([0.3, 0.01]))
    slots = torch.tensor([0, 5, -1, 9, 30, 17])
    want = _prologue(reference, qkv, heads, w_q, w_k, positions, cos_sin, slots, F8, scales)
    got = _prologue(cpu_fused, qkv, heads, w_q, w_k, positions, cos_sin, slots, F8, scales,
                    step_cache={})
    assert all(_same_bytes(g, w) for g, w in zip(got, want))


def test_step_cache_serves_every_layer_and_only_its_own_tensors() -> None:
    """Layers of one step share the cos/sin rows and slots; other positions (a draft model
    sharing the step's metadata) or another table make their own, never the cached ones."""
    heads = (4, 2, 32)
    qkv, w_q, w_k, positions, cos_sin = _prologue_inputs(torch.bfloat16, heads, 5, seed=9)
    slots = torch.tensor([3, 8, -1, 1, 22])
    step: dict = {}
    first = _prologue(cpu_fused, qkv, heads, w_q, w_k, positions, cos_sin, slots,
                      torch.bfloat16, step_cache=step)
    cached = dict(step)
    assert set(cached) == {("cpu_fused.cos_sin", torch.bfloat16), "cpu_fused.slots"}
    second = _prologue(cpu_fused, qkv, heads, w_k, w_q, positions, cos_sin, slots,
                       torch.bfloat16, step_cache=step)  # another layer's weights
    assert all(step[key] is cached[key] for key in cached)  # reused, not remade
    want = _prologue(reference, qkv, heads, w_k, w_q, positions, cos_sin, slots, torch.bfloat16)
    assert all(_same_bytes(g, w) for g, w in zip(second, want))
    assert not _same_bytes(first[0], second[0])
    other = positions.flip(0)  # same values, reordered: a new tensor
    got = _prologue(cpu_fused, qkv, heads, w_q, w_k, other, cos_sin, slots, torch.bfloat16,
                    step_cache=step)
    want = _prologue(reference, qkv, heads, w_q, w_k, other, cos_sin, slots, torch.bfloat16)
    assert all(_same_bytes(g, w) for g, w in zip(got, want))
    yarn_like = cos_sin * 1.5  # another model's table at the same positions
    got = _prologue(cpu_fused, qkv, heads, w_q, w_k, other, yarn_like, slots, torch.bfloat16,
                    step_cache=step)
    want = _prologue(reference, qkv, heads, w_q, w_k, other, yarn_like, slots, torch.bfloat16)
    assert all(_same_bytes(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(16, 1024), (64, 128), (1, 128), (3, 5, 64)], ids=str)
def test_rms_norm_is_bit_identical_and_leaves_its_inputs(dtype: torch.dtype,
                                                         shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(shape, generator=gen) * 4).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    assert _same_bytes(cpu_fused.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    got, got_residual = cpu_fused.rms_norm(x, weight, 1e-6, residual)
    want, want_residual = reference.rms_norm(x, weight, 1e-6, residual)
    assert _same_bytes(got, want) and _same_bytes(got_residual, want_residual)
    assert _same_bytes(x, x_before) and _same_bytes(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_is_bit_identical_and_leaves_its_input(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(16, 2 * 3072, generator=gen) * 4).to(dtype)
    before = x.clone()
    assert _same_bytes(cpu_fused.silu_and_mul(x), reference.silu_and_mul(x))
    assert _same_bytes(x, before)


def test_auto_on_cpu_runs_the_fused_ops_and_torch_the_twins() -> None:
    """One dispatch point: `auto` takes kernels/cpu_fused.py on CPU (it fills the step cache),
    `torch` the reference twin (it takes none)."""
    heads = (4, 2, 16)
    qkv, w_q, w_k, positions, cos_sin = _prologue_inputs(torch.float32, heads, 3, seed=2)
    for backend, filled in (("auto", True), ("torch", False)):
        step: dict = {}
        k_cache = torch.zeros(2, 4, 2, 16)
        kernels.qk_norm_rope_write_kv(qkv.clone(), 4, 2, w_q, w_k, 1e-6, positions, cos_sin,
                                      k_cache, torch.zeros_like(k_cache),
                                      torch.tensor([0, 1, 2]), backend=backend, step_cache=step)
        assert bool(step) is filled
