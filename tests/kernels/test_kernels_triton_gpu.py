"""The interpreter cases again on CUDA, compiled for real, plus bf16 and Qwen3-0.6B's shapes."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    DECODE,
    MIXED,
    check_paged_attention,
    check_rms_norm,
    check_rotary,
    check_silu_and_mul,
    check_write_kv,
    make_paged_batch,
)

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(2, 2), (4, 2), (8, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_scatters_exactly_and_skips_padding_slots(dtype: torch.dtype) -> None:
    check_write_kv("cuda", dtype)


@pytest.mark.parametrize("num_segments", [1, 4])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_matches_reference(dtype: torch.dtype, heads: tuple[int, int],
                                            num_segments: int) -> None:
    batch = make_paged_batch(DECODE, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=32,
                             block_size=4, dtype=dtype, device="cuda")
    check_paged_attention(batch, num_segments=num_segments, tile_n=16)


@pytest.mark.parametrize("num_segments", [1, 2])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_prefill_decode_attention_matches_reference(
        dtype: torch.dtype, heads: tuple[int, int], num_segments: int) -> None:
    batch = make_paged_batch(MIXED, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=32,
                             block_size=4, dtype=dtype, device="cuda", share_first_block=True)
    check_paged_attention(batch, num_segments=num_segments, tile_n=16)


@pytest.mark.parametrize("num_segments", [None, 1, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qwen3_0_6b_shapes_with_default_tiles(dtype: torch.dtype, num_segments: int | None
                                              ) -> None:
    # 16 query heads, 8 KV heads, head_dim 128, block 16: long decodes and a 300-token chunk
    # on a 1000-token cached prefix.
    lens = [(1, 4099), (1, 17), (300, 1300), (1, 2048), (64, 64)]
    batch = make_paged_batch(lens, num_q_heads=16, num_kv_heads=8, head_dim=128, block_size=16,
                             dtype=dtype, device="cuda", share_first_block=True, seed=9)
    check_paged_attention(batch, num_segments=num_segments)


def test_long_decode_batch_auto_split_matches() -> None:
    batch = make_paged_batch([(1, 32768), (1, 5000)], num_q_heads=16, num_kv_heads=8,
                             head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda")
    check_paged_attention(batch)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(5, 48), (3, 4, 16), (7, 1024)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype: torch.dtype, shape: tuple[int, ...],
                                    residual: bool) -> None:
    check_rms_norm("cuda", dtype, shape, residual)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_in_place_matches_reference(dtype: torch.dtype) -> None:
    check_rotary("cuda", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    check_silu_and_mul("cuda", dtype)


def test_auto_backend_picks_triton_on_cuda() -> None:
    import kernels

    batch = make_paged_batch(MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                             dtype=torch.bfloat16, device="cuda", seed=10)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
            batch.seq_lens, batch.scale, batch.max_query_len, batch.max_seq_len)
    torch.testing.assert_close(kernels.paged_attention(*args),
                               kernels.paged_attention(*args, backend="torch"),
                               atol=1.6e-2, rtol=1.6e-2)
