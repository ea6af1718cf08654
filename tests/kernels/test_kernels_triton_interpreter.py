"""Interpreter-only Triton cases on CPU (TRITON_INTERPRET=1, toy sizes); the cases shared
with CUDA are in test_kernels_triton.py. Tolerances are kernel_cases.TOL.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    INTERPRETER_ONLY,
    MIXED,
    check_paged_attention,
    make_paged_batch,
)

pytestmark = INTERPRETER_ONLY


def test_query_blocks_span_several_programs_per_sequence() -> None:
    # block_m 16 with GQA 2 gives 8 query tokens per program: the 13- and 9-token chunks need
    # two programs each, and the binary search must map every program to its own sequence.
    batch = make_paged_batch([(13, 20), (1, 9), (9, 9)], num_q_heads=4, num_kv_heads=2,
                             head_dim=32, block_size=4, dtype=torch.float32, device="cpu", seed=5)
    check_paged_attention(batch, block_m=16, tile_n=16)


@pytest.mark.parametrize("head_dim", [24, 64, 128])
def test_attention_head_dims_including_padded(head_dim: int) -> None:
    batch = make_paged_batch([(2, 9), (1, 18)], num_q_heads=4, num_kv_heads=2, head_dim=head_dim,
                             block_size=16, dtype=torch.float16, device="cpu", seed=6)
    check_paged_attention(batch, tile_n=16)


def test_long_decode_takes_split_k_automatically_and_matches() -> None:
    from kernels.attention_split import NOMINAL_SM_COUNT, choose_num_segments

    batch = make_paged_batch([(1, 700)], num_q_heads=2, num_kv_heads=1, head_dim=16,
                             block_size=16, dtype=torch.float32, device="cpu", seed=7)
    assert choose_num_segments(1, 1, 1, 700, 64, NOMINAL_SM_COUNT) == 8
    check_paged_attention(batch)


def test_long_chunk_beside_short_sequences_takes_two_launches() -> None:
    # A 130-token chunk (unfolded 128-row tiles) and decodes and a short chunk (folded tiles):
    # each launch computes only its own sequences' rows, together all of them.
    from kernel_cases import load_launch_counter

    batch = make_paged_batch([(1, 9), (130, 150), (20, 61), (1, 40)], num_q_heads=4,
                             num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32,
                             device="cpu", seed=14)
    with load_launch_counter().LaunchCounter().counting() as counter:
        check_paged_attention(batch, with_chunk_kv=True)
    assert counter.launches.count("triton._paged_attention_kernel") == 2


def test_dispatch_triton_backend_runs_kernels_on_cpu_under_interpreter() -> None:
    import kernels

    batch = make_paged_batch(MIXED, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                             dtype=torch.float32, device="cpu", seed=8)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
            batch.seq_lens, batch.scale, batch.max_query_len, batch.max_seq_len)
    torch.testing.assert_close(kernels.paged_attention(*args, backend="triton"),
                               kernels.paged_attention(*args, backend="torch"),
                               atol=2e-5, rtol=2e-5)
