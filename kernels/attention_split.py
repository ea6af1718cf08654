"""The split-K (FlashDecoding) policy of the Triton paged-attention kernel
(kernels/triton_attention.py): how many key segments a decode batch is cut into, from a table of
H100 measurements, and the decode batches that reach each factor (what a start-up warm-up runs so
that no decode step compiles later). Host-side integers only: no Triton, no device sync, so a
CUDA graph captured at a given (batch, max_seq_len) replays the same path.
"""

from __future__ import annotations

import math

import torch

TILE_N = 64  # keys per tile, unless a caller forces another
MAX_SEGMENTS = 16
NOMINAL_SM_COUNT = 132  # used off-GPU (interpreter), where there is no device to ask

# Best split-K factor per (decode batch, context), measured on an H100 (132 SMs) with 8 KV heads
# and 64-key tiles, each timed as a CUDA-graph replay: ../shared/gpu/h100-2026-11-22/
# attn_sweep.json (segments 1-16 at contexts 128-2048) and kernels.json (4096, 32768).
# Rows are keyed by decode programs per SM (batch * KV heads / SMs), columns by key tiles.
_MEASURED_PROGRAMS_PER_SM = (8 / 132, 256 / 132, 2048 / 132)  # batch 1, 32, 256
_MEASURED_TILES = (2, 8, 16, 32, 64, 512)  # contexts 128, 512, 1024, 2048, 4096, 32768
_MEASURED_BEST_SEGMENTS = (
    (1, 8, 16, 16, 16, 16),
    (1, 2, 2, 2, 2, 2),
    (1, 1, 1, 1, 1, 1),
)


def device_sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NOMINAL_SM_COUNT


def _nearest(values: tuple[float, ...], x: float) -> int:
    """Index of the entry of `values` closest to x on a log scale."""
    return min(range(len(values)), key=lambda i: abs(math.log(values[i] / x)))


def choose_num_segments(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                        tile_n: int, sm_count: int) -> int:
    """Split-K factor (a power of two, 1 = no split) for a batch; only pure-decode batches split.

    Looks up the measured best factor at the nearest measured point (programs per SM, key
    tiles); never more segments than key tiles. The choice depends only on host-side integers,
    so a CUDA graph captured at a given (batch, max_seq_len) replays the same path.
    """
    if max_query_len != 1:
        return 1
    tiles = max(1, -(-max_seq_len // tile_n))
    row = _programs_row(num_seqs, num_kv_heads, sm_count)
    col = _nearest(_MEASURED_TILES, tiles)
    segments = min(_MEASURED_BEST_SEGMENTS[row][col], tiles, MAX_SEGMENTS)
    return 1 << (segments.bit_length() - 1)  # round down to a power of two


def _programs_row(num_seqs: int, num_kv_heads: int, sm_count: int) -> int:
    """The row of the measured table a decode batch of `num_seqs` sequences looks up."""
    return _nearest(_MEASURED_PROGRAMS_PER_SM, num_seqs * num_kv_heads / sm_count)


def decode_launch_shapes(max_num_seqs: int, num_kv_heads: int, max_model_len: int,
                         device: torch.device) -> list[tuple[int, int]]:
    """One decode batch (batch size, max_seq_len) per split-K factor that `choose_num_segments`
    picks for some decode batch of at most `max_num_seqs` sequences within `max_model_len`:
    each factor is its own compiled kernel (and merge kernel), so a warm-up that runs these
    batches leaves no decode step to compile. The choice depends on the batch size only through
    its row of the measured table, so the smallest batch size of each row stands for the rest;
    each factor comes with the smallest context that picks it."""
    sms = device_sm_count(device)
    first_of_row: dict[int, int] = {}
    for num_seqs in range(1, max_num_seqs + 1):
        first_of_row.setdefault(_programs_row(num_seqs, num_kv_heads, sms), num_seqs)
    shapes: dict[int, tuple[int, int]] = {}
    for num_seqs in sorted(first_of_row.values()):
        for tiles in range(1, -(-max_model_len // TILE_N) + 1):
            seq_len = min(tiles * TILE_N, max_model_len)
            segments = choose_num_segments(num_seqs, num_kv_heads, 1, seq_len, TILE_N, sms)
            shapes.setdefault(segments, (num_seqs, seq_len))
    return sorted(shapes.values())
