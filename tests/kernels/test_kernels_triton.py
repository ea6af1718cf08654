"""The cases every Triton kernel must pass against its torch twin, on each device.

On CPU they run through TRITON_INTERPRET=1 in fp32/fp16 (the interpreter computes `tl.dot`
on bf16 wrongly); on CUDA (marked `gpu`) they run compiled, bf16 included. Tolerances are
kernel_cases.TOL. Device-specific cases live in test_kernels_triton_interpreter.py and
test_kernels_triton_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    DECODE,
    INTERPRETER_ONLY,
    MIXED,
    PREFILL,
    check_paged_attention,
    check_qk_norm_rope_write_kv,
    check_rms_norm,
    check_rotary,
    check_silu_and_mul,
    check_write_kv,
    make_paged_batch,
)

_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
DEVICE_DTYPES = (
    [pytest.param("cpu", d, marks=INTERPRETER_ONLY, id=f"cpu-{_NAMES[d]}")
     for d in (torch.float32, torch.float16)]
    + [pytest.param("cuda", d, marks=pytest.mark.gpu, id=f"cuda-{_NAMES[d]}")
       for d in (torch.float32, torch.float16, torch.bfloat16)])
# (num_q_heads, num_kv_heads): GQA ratios 1, 2 and 8.
HEADS = [(2, 2), (4, 2), (8, 1)]


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_write_kv_scatters_exactly_and_skips_padding_slots(device: str,
                                                           dtype: torch.dtype) -> None:
    check_write_kv(device, dtype)


@pytest.mark.parametrize(("num_segments", "chunk_kv"), [(1, False), (4, False), (4, True)])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_decode_attention_matches_reference(device: str, dtype: torch.dtype,
                                            heads: tuple[int, int], num_segments: int,
                                            chunk_kv: bool) -> None:
    batch = make_paged_batch(DECODE, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=32,
                             block_size=4, dtype=dtype, device=device)
    check_paged_attention(batch, num_segments=num_segments, tile_n=16, with_chunk_kv=chunk_kv)


@pytest.mark.parametrize(("num_segments", "chunk_kv"), [(1, False), (2, False), (1, True)])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_mixed_prefill_decode_attention_matches_reference(
        device: str, dtype: torch.dtype, heads: tuple[int, int], num_segments: int,
        chunk_kv: bool) -> None:
    batch = make_paged_batch(MIXED, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=32,
                             block_size=4, dtype=dtype, device=device, share_first_block=True)
    check_paged_attention(batch, num_segments=num_segments, tile_n=16, with_chunk_kv=chunk_kv)


@pytest.mark.parametrize("chunk_kv", [False, True])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_long_chunk_tiles_over_cached_prefixes_match_reference(
        device: str, dtype: torch.dtype, heads: tuple[int, int], chunk_kv: bool) -> None:
    # The unfolded prefill tiles (one query head per program) at toy size: 16-row query
    # blocks, 16-key tiles, block size 4. Chunks with no prefix, with a prefix that ends
    # mid-tile and mid-block, several query blocks per chunk, and a decode among them.
    batch = make_paged_batch(PREFILL, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=32,
                             block_size=4, dtype=dtype, device=device, share_first_block=True,
                             seed=11)
    check_paged_attention(batch, fold_gqa=False, block_m=16, tile_n=16, with_chunk_kv=chunk_kv)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(5, 48), (3, 4, 16)])
@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_rms_norm_matches_reference(device: str, dtype: torch.dtype, shape: tuple[int, ...],
                                    residual: bool) -> None:
    check_rms_norm(device, dtype, shape, residual)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_rotary_embedding_in_place_matches_reference(device: str, dtype: torch.dtype) -> None:
    check_rotary(device, dtype)


@pytest.mark.parametrize("head_dim", [16, 24])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_qk_norm_rope_write_kv_matches_reference(device: str, dtype: torch.dtype,
                                                 heads: tuple[int, int], head_dim: int) -> None:
    check_qk_norm_rope_write_kv(device, dtype, heads[0], heads[1], head_dim)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_silu_and_mul_matches_reference(device: str, dtype: torch.dtype) -> None:
    check_silu_and_mul(device, dtype)
