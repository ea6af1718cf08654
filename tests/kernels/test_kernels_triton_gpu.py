"""CUDA-only Triton cases: Qwen3-0.6B's shapes, long chunks with the Hopper-sized prefill tiles,
32k decodes, wide rows, auto dispatch, a decode layer captured in a CUDA graph.

The cases shared with the interpreter run on CUDA from test_kernels_triton.py."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    MIXED,
    check_paged_attention,
    check_qk_norm_rope_write_kv,
    check_rms_norm,
    load_launch_counter,
    make_paged_batch,
)

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


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


@pytest.mark.parametrize("chunk_kv", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_chunks_with_default_tiles(dtype: torch.dtype, chunk_kv: bool) -> None:
    # Chunks >= 128 tokens take the unfolded 128-row tiles: no prefix, a prefix, a decode.
    lens = [(2048, 2048), (1500, 4000), (1, 3000), (300, 300)]
    batch = make_paged_batch(lens, num_q_heads=16, num_kv_heads=8, head_dim=128, block_size=16,
                             dtype=dtype, device="cuda", share_first_block=True, seed=13)
    check_paged_attention(batch, with_chunk_kv=chunk_kv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_write_kv_at_qwen3_0_6b_shapes(dtype: torch.dtype) -> None:
    check_qk_norm_rope_write_kv("cuda", dtype, 16, 8, 128)


def test_decode_layer_replays_in_a_cuda_graph_as_it_runs_eagerly() -> None:
    """Captured with max_seq_len 4096 (split-K): no host reads, no data-dependent shapes."""
    bench = load_launch_counter()
    cfg = bench.model_config()
    _, step = bench.build_decode_layer(cfg, 32, 1000, torch.bfloat16, torch.device("cuda"),
                                       "auto", 4096)
    with torch.inference_mode():
        eager = step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        graph.replay()
        torch.cuda.synchronize()
    for got, expected in zip(captured, eager):
        assert torch.equal(got, expected)


def test_long_decode_batch_auto_split_matches() -> None:
    batch = make_paged_batch([(1, 32768), (1, 5000)], num_q_heads=16, num_kv_heads=8,
                             head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda")
    check_paged_attention(batch)


def test_auto_backend_picks_triton_on_cuda() -> None:
    import kernels

    batch = make_paged_batch(MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                             dtype=torch.bfloat16, device="cuda", seed=10)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
            batch.seq_lens, batch.scale, batch.max_query_len, batch.max_seq_len)
    torch.testing.assert_close(kernels.paged_attention(*args),
                               kernels.paged_attention(*args, backend="torch"),
                               atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_wide_rows_match_reference(dtype: torch.dtype, residual: bool) -> None:
    check_rms_norm("cuda", dtype, (7, 1024), residual)
