"""The CPU path of paged attention (kernels/cpu_attention.py: decode rows in the C++ op, or on
torch's fused SDPA where the op is not built; prefill on SDPA) against the plain-torch reference
twin, on NaN-poisoned caches (padding blocks and the rows past each sequence's length hold NaN,
so a read of them shows up). Tests that hold for both decode paths run on each; the C++ op's
own cases are tests/kernels/test_cpu_paged_op.py."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import make_paged_batch

import kernels
from kernels import cpu_attention, cpu_extension, reference

DECODE = [(1, 9), (1, 1), (1, 33), (1, 16), (1, 17)]
MIXED = [(1, 9), (1, 1), (1, 33), (5, 12), (1, 16), (7, 7), (1, 17), (3, 3)]
PREFILL = [(6, 6), (4, 19), (1, 1)]


@pytest.fixture(params=["op", "sdpa"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Decode rows in the C++ op (built here if it is not yet) or in the SDPA fallback."""
    if request.param == "op":
        cpu_extension.build(quiet=True)
        monkeypatch.setattr(cpu_extension, "_loaded", {})
        assert cpu_extension.paged_attention_rows() is not None
    else:
        monkeypatch.setattr(cpu_extension, "_loaded", {"paged_attention_rows": None})
    return request.param


@pytest.fixture
def sdpa_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_extension, "_loaded", {"paged_attention_rows": None})


def _run(batch, impl, **scales):  # noqa: ANN001, ANN202 — a test helper over PagedBatch
    return impl.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                batch.query_start_loc, batch.seq_lens, batch.scale, **scales)


@pytest.mark.parametrize("lens", [DECODE, MIXED, PREFILL], ids=["decode", "mixed", "prefill"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa4", "mha"])
def test_cpu_attention_matches_the_reference_fp32(lens: list[tuple[int, int]],
                                                  heads: tuple[int, int], decode_path: str) -> None:
    batch = make_paged_batch(lens, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=16,
                             block_size=4, dtype=torch.float32, device="cpu",
                             share_first_block=True, seed=7)
    got = _run(batch, cpu_attention)
    assert got.shape == batch.q.shape and not got.isnan().any()
    torch.testing.assert_close(got, _run(batch, reference), atol=2e-6, rtol=2e-6)


def test_decode_chunks_give_the_same_rows(monkeypatch: pytest.MonkeyPatch, sdpa_only: None) -> None:
    """Rows attended one per chunk equal the rows attended all at once."""
    batch = make_paged_batch(DECODE, num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=4,
                             dtype=torch.float32, device="cpu", seed=8)
    whole = _run(batch, cpu_attention)
    monkeypatch.setattr(cpu_attention, "DECODE_CHUNK_ELEMENTS", 1)
    torch.testing.assert_close(_run(batch, cpu_attention), whole, atol=1e-6, rtol=1e-6)


def test_bf16_attends_within_bf16_rounding_of_the_float32_reference(decode_path: str) -> None:
    batch = make_paged_batch(MIXED, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                             dtype=torch.bfloat16, device="cpu", seed=9)
    got = _run(batch, cpu_attention)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    torch.testing.assert_close(got, _run(batch, reference), atol=2e-2, rtol=2e-2)


def test_fp8_cache_is_read_times_its_scales(decode_path: str) -> None:
    batch = make_paged_batch(MIXED, num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=4,
                             dtype=torch.float32, device="cpu", seed=10)
    # per KV head: the heads' magnitudes 50x apart, each over its own scale
    batch.k_cache[:, :, 1] *= 50
    batch.v_cache[:, :, 0] *= 50
    k_scale, v_scale = torch.tensor([0.5, 25.0]), torch.tensor([100.0, 2.0])
    fp8 = dict(k_scale=k_scale, v_scale=v_scale)
    batch.k_cache = reference.quantize_kv(batch.k_cache, reference.FP8_KV_DTYPE, k_scale)
    batch.v_cache = reference.quantize_kv(batch.v_cache, reference.FP8_KV_DTYPE, v_scale)
    got = _run(batch, cpu_attention, **fp8)
    assert not got.isnan().any()
    torch.testing.assert_close(got, _run(batch, reference, **fp8), atol=2e-6, rtol=2e-6)


def test_dispatch_auto_runs_the_cpu_path_and_torch_the_reference(
        monkeypatch: pytest.MonkeyPatch, decode_path: str) -> None:
    batch = make_paged_batch(MIXED, num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=4,
                             dtype=torch.float32, device="cpu", seed=11)
    calls: list[str] = []
    for name, module in (("cpu", cpu_attention), ("reference", reference)):
        real = module.paged_attention
        monkeypatch.setattr(module, "paged_attention",
                            lambda *a, _real=real, _name=name, **k: calls.append(_name)
                            or _real(*a, **k))
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
            batch.seq_lens, batch.scale, batch.max_query_len, batch.max_seq_len)
    kernels.paged_attention(*args)
    kernels.paged_attention(*args, backend="torch")
    assert calls == ["cpu", "reference"]


@pytest.mark.parametrize("lens", [DECODE, MIXED], ids=["decode", "mixed"])
def test_step_cache_makes_the_plan_once_and_every_layer_reuses_it(
        lens: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch, decode_path: str) -> None:
    """Layers sharing one step's metadata share one DecodePlan, and attend exactly as a call
    without a cache does; another cache geometry (a draft model's layers) gets its own."""
    batch = make_paged_batch(lens, num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=4,
                             dtype=torch.float32, device="cpu", share_first_block=True, seed=12)
    made: list[object] = []
    real = cpu_attention.DecodePlan.make
    monkeypatch.setattr(cpu_attention.DecodePlan, "make",
                        staticmethod(lambda *a: made.append(a) or real(*a)))
    alone = _run(batch, cpu_attention)
    cache: dict = {}
    layers = [_run(batch, cpu_attention, step_cache=cache) for _ in range(3)]
    assert len(made) == 2 and len(cache) == 1
    for out in layers:
        torch.testing.assert_close(out, alone, atol=0, rtol=0)
    wide = torch.cat([batch.k_cache, batch.k_cache], dim=-1)  # head_dim 32: another geometry
    q = torch.cat([batch.q, batch.q], dim=-1)
    cpu_attention.paged_attention(q, wide, wide, batch.block_tables, batch.query_start_loc,
                                  batch.seq_lens, batch.scale, step_cache=cache)
    assert len(made) == 3 and len(cache) == 2


def test_decode_padding_is_masked_not_read_into_the_sum(sdpa_only: None) -> None:
    """A bucket padded to its longest row: the short rows' padding positions hold NaN in the
    cache, yet every row equals the reference (the mask weighs their stand-in rows zero)."""
    lens = [(1, 2), (1, 30), (1, 5), (1, 17)]
    batch = make_paged_batch(lens, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                             dtype=torch.bfloat16, device="cpu", seed=13)
    plan = cpu_attention.DecodePlan.make(batch.block_tables, batch.query_start_loc,
                                         batch.seq_lens, batch.k_cache.shape, torch.bfloat16)
    assert plan.rows is None and len(plan.buckets) == 1
    assert plan.buckets[0].mask.shape == (4, 1, 1, 32)  # the longest, to whole blocks of 4
    assert int(plan.buckets[0].mask.isinf().sum()) == 4 * 32 - (2 + 30 + 5 + 17)
    got = _run(batch, cpu_attention)
    assert not got.isnan().any()
    torch.testing.assert_close(got, _run(batch, reference), atol=2e-2, rtol=2e-2)
