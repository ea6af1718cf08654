"""The C++ CPU paged attention (kernels/csrc/paged_attention_cpu.cpp) against the plain-torch
reference twin, on NaN-poisoned caches (blocks no sequence uses, table padding and the rows past
each sequence's length hold NaN, so a read of them shows up).

The library is built here when it is not yet (what scripts/bootstrap.sh does); a build that
fails fails these tests with the compiler's message.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kernel_cases import TOL, make_paged_batch

import kernels
from kernels import cpu_attention, cpu_extension, reference


@pytest.fixture(scope="module")
def op() -> Callable:
    cpu_extension.build(quiet=True)
    cpu_extension._loaded.clear()  # (a process that looked before the build)
    loaded = cpu_extension.paged_attention_rows()
    assert loaded is not None
    return loaded


def _attend(op: Callable, batch, seqs: list[int] | None = None) -> torch.Tensor:  # noqa: ANN001
    """The op over `seqs` (default: every sequence), into an output poisoned with NaN."""
    out = torch.full_like(batch.q, float("nan"))
    chosen = torch.arange(batch.seq_lens.shape[0]) if seqs is None else torch.tensor(seqs)
    op(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
       batch.seq_lens, chosen, batch.scale, out)
    return out


def _reference(batch) -> torch.Tensor:  # noqa: ANN001
    return reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                     batch.query_start_loc, batch.seq_lens, batch.scale)


# (query rows, seq_len) per sequence: lengths 1 .. past several blocks, both sides of block
# boundaries (block sizes 4, 16 and 32), verify-like rows (2-8 query tokens).
DECODE = [(1, 1), (1, 3), (1, 4), (1, 5), (1, 16), (1, 17), (1, 31), (1, 32), (1, 33), (1, 100)]
VERIFY = [(1, 9), (2, 2), (3, 20), (4, 17), (5, 33), (8, 40), (1, 1), (6, 64)]


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("heads", [(16, 8), (8, 2), (4, 4), (14, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [128, 64, 32, 20])
@pytest.mark.parametrize("lens", [DECODE, VERIFY], ids=["decode", "verify"])
def test_op_matches_the_reference_fp32(op: Callable, lens: list[tuple[int, int]],
                                       head_dim: int, heads: tuple[int, int],
                                       block_size: int) -> None:
    """GQA groups of 1-7 heads (more than one pass of 8 query vectors at 14q/2kv with verify
    rows), head_dim 20 exercising the scalar tail."""
    batch = make_paged_batch(lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                             head_dim=head_dim, block_size=block_size, dtype=torch.float32,
                             device="cpu", share_first_block=True, seed=head_dim + block_size)
    got = _attend(op, batch)
    assert not got.isnan().any()
    torch.testing.assert_close(got, _reference(batch), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [128, 32])
def test_op_attends_within_rounding_of_the_float32_reference(op: Callable, dtype: torch.dtype,
                                                             head_dim: int) -> None:
    batch = make_paged_batch(DECODE + VERIFY, num_q_heads=16, num_kv_heads=8, head_dim=head_dim,
                             block_size=16, dtype=dtype, device="cpu", seed=5)
    got = _attend(op, batch)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got, _reference(batch), atol=TOL[dtype], rtol=TOL[dtype])


def test_many_sequences_in_one_call(op: Callable) -> None:
    """64 sequences of random lengths up to 300 (all of them work items for the threads)."""
    gen = torch.Generator().manual_seed(3)
    lens = [(1, int(n)) for n in torch.randint(1, 300, (64,), generator=gen)]
    batch = make_paged_batch(lens, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                             dtype=torch.float32, device="cpu", seed=4)
    torch.testing.assert_close(_attend(op, batch), _reference(batch), atol=2e-6, rtol=2e-6)


def test_only_the_chosen_sequences_rows_are_written(op: Callable) -> None:
    batch = make_paged_batch(VERIFY, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                             dtype=torch.float32, device="cpu", seed=6)
    chosen = [0, 3, 6]
    got, want = _attend(op, batch, chosen), _reference(batch)
    starts = batch.query_start_loc.tolist()
    for b in range(len(VERIFY)):
        rows = got[starts[b]:starts[b + 1]]
        if b in chosen:
            torch.testing.assert_close(rows, want[starts[b]:starts[b + 1]], atol=2e-6, rtol=2e-6)
        else:
            assert rows.isnan().all()


def test_strided_query_rows_are_read_in_place(op: Callable) -> None:
    """q as the workers pass it: a view of the fused QKV projection's rows."""
    batch = make_paged_batch(DECODE, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                             dtype=torch.float32, device="cpu", seed=7)
    wide = torch.cat([batch.q.flatten(1), torch.full((batch.q.shape[0], 128), float("nan"))], 1)
    batch.q = wide[:, :256].view(-1, 8, 32)
    assert not batch.q.is_contiguous()
    torch.testing.assert_close(_attend(op, batch), _reference(batch), atol=2e-6, rtol=2e-6)


def test_dispatch_sends_few_row_sequences_to_the_op_and_prefill_to_sdpa(
        op: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    lens = [(1, 9), (8, 30), (9, 30), (40, 40), (1, 1)]
    batch = make_paged_batch(lens, num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                             dtype=torch.float32, device="cpu", seed=8)
    monkeypatch.setitem(cpu_extension._loaded, "paged_attention_rows", op)
    attended: list[int] = []
    real = cpu_attention._sequence
    monkeypatch.setattr(cpu_attention, "_sequence",
                        lambda q, *a: attended.append(q.shape[0]) or real(q, *a))
    got = kernels.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                  batch.query_start_loc, batch.seq_lens, batch.scale,
                                  batch.max_query_len, batch.max_seq_len)
    assert attended == [9, 40]
    torch.testing.assert_close(got, _reference(batch), atol=2e-6, rtol=2e-6)


def test_an_fp8_cache_goes_to_sdpa(op: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cpu_extension._loaded, "paged_attention_rows", op)
    batch = make_paged_batch([(1, 9), (1, 20)], num_q_heads=4, num_kv_heads=2, head_dim=16,
                             block_size=4, dtype=torch.float32, device="cpu", seed=9)
    fp8 = batch.k_cache.to(reference.FP8_KV_DTYPE)
    assert cpu_attention._op_for(batch.q, fp8, batch.block_tables, batch.query_start_loc,
                                 batch.seq_lens) is None
    assert cpu_attention._op_for(batch.q, batch.k_cache, batch.block_tables,
                                 batch.query_start_loc, batch.seq_lens) is op


def test_a_missing_library_says_so_once_and_falls_back(
        tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    monkeypatch.setattr(cpu_extension, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(cpu_extension, "_loaded", {})
    assert cpu_extension.paged_attention_rows() is None
    assert cpu_extension.paged_attention_rows() is None
    assert cpu_extension.sample_rows() is None
    err = capsys.readouterr().err
    assert err.count("scripts/bootstrap.sh builds them") == 1


def test_a_build_without_a_compiler_raises_a_clear_error(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(cpu_extension, "BUILD_DIR", tmp_path)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu_extension.build(quiet=True)
