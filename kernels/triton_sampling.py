"""Triton twin of `reference.sample_tokens`: one token per row, one pass over the logits.

The torch twin's algorithm, as two launches, no `[S, V]` temporary:
1. `_chunk_stats_kernel`, grid (rows, chunk groups): reads each logit once (any float dtype),
   divides by the row's temperature, and writes per chunk of `SAMPLE_CHUNK` tokens its max and
   the sum of `exp(x - chunk max)`. A chunk's stats depend on its own logits only, so
   the chunks per program may follow the batch size (more programs for a small batch).
2. `_pick_kernel`, grid (rows,): the stream's uniform (splitmix64 of key and counter, the
   bits `reference.uniform` computes), the row max, chunk masses rescaled to it, their running
   sum in blocks of `_PICK_BLOCK` chunks (fixed, so a row's sums never depend on the batch), the
   chunk the uniform falls in (or the first maximum's chunk for a greedy row), then the token
   inside that chunk from its `SAMPLE_CHUNK` logits read again.
Both twins make the same choices at every step (which chunk, which offset, the clamps that keep
the draw on a token of positive weight); they differ only in float rounding (exp, the order of
sums), so a row's token can differ only when its uniform falls within a rounding error of a
boundary between two tokens. Nothing here syncs with the host or sizes anything by values: the
pair is safe inside CUDA-graph capture.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from kernels.reference import SAMPLE_CHUNK

# Chunks per step of the pick kernel's running sum: a whole 152k vocabulary in two steps.
_PICK_BLOCK = 1024
# libdevice's expf is correctly rounded to within an ulp like torch's; `tl.exp` (ex2.approx)
# is not. The interpreter has no libdevice and uses numpy's exp.
_LIBDEVICE_EXP = os.environ.get("TRITON_INTERPRET") != "1"

# 2**-40: how far below the chunk's running total the rest is kept.
_BELOW_ONE = tl.constexpr(9.094947017729282e-13)
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
_MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MIX2 = tl.constexpr(0x94D049BB133111EB)


@triton.jit
def _exp(x, LIBDEVICE_EXP: tl.constexpr):
    if LIBDEVICE_EXP:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _scaled_logits(logits_ptr, row_start, cols, mask, t):
    """The row's float32 logits at `cols` divided by `t` (IEEE division, as torch divides)."""
    x = tl.load(logits_ptr + row_start + cols, mask=mask, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(x, t)


@triton.jit
def _row_temperature(temperature_ptr, row, HAS_TEMPERATURE: tl.constexpr):
    """The row's temperature as given (1.0 when the logits come already scaled)."""
    if HAS_TEMPERATURE:
        return tl.load(temperature_ptr + row)
    else:
        return tl.full((), 1.0, tl.float32)


# The per-row inputs (temperature, stream key and counter) are views into the step's staging
# buffer at offsets that follow its token and row counts: never specialised on their 16-byte
# alignment (each row reads one value), so one compiled kernel serves every batch.
_PER_ROW = ["temperature_ptr", "key_ptr", "counter_ptr"]


@triton.jit(do_not_specialize_on_alignment=_PER_ROW[:1])
def _chunk_stats_kernel(
    logits_ptr, temperature_ptr, cmax_ptr, csum_ptr, stride_row, vocab, num_chunks,
    HAS_TEMPERATURE: tl.constexpr, CHUNK: tl.constexpr, CHUNKS_PER_PROG: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.program_id(1) * CHUNKS_PER_PROG + tl.arange(0, CHUNKS_PER_PROG)
    cols = chunks[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    t = _row_temperature(temperature_ptr, row, HAS_TEMPERATURE)
    t = tl.where(t > 0, t, 1.0)  # a greedy row keeps its logits
    x = _scaled_logits(logits_ptr, row * stride_row, cols, cols < vocab, t)
    cmax = tl.max(x, axis=1)
    w = _exp(x - tl.where(cmax == float("-inf"), 0.0, cmax)[:, None], LIBDEVICE_EXP)
    csum = tl.sum(w, axis=1)
    keep = chunks < num_chunks
    tl.store(cmax_ptr + row * num_chunks + chunks, cmax, mask=keep)
    tl.store(csum_ptr + row * num_chunks + chunks, csum, mask=keep)


@triton.jit
def _chunk_masses(cmax_ptr, csum_ptr, base, idx, num_chunks, row_max,
                  LIBDEVICE_EXP: tl.constexpr):
    """The chunks `idx`: their max and their mass relative to the row max (0 past the end)."""
    keep = idx < num_chunks
    cmax = tl.load(cmax_ptr + base + idx, mask=keep, other=float("-inf"))
    csum = tl.load(csum_ptr + base + idx, mask=keep, other=0.0).to(tl.float64)
    scale = _exp(cmax.to(tl.float64) - row_max.to(tl.float64), LIBDEVICE_EXP)
    mass = tl.where(csum > 0, csum * scale, 0.0)
    return cmax, mass


@triton.jit(do_not_specialize_on_alignment=_PER_ROW)
def _pick_kernel(
    logits_ptr, temperature_ptr, key_ptr, counter_ptr, cmax_ptr, csum_ptr, out_ptr,
    stride_row, vocab, num_chunks,
    HAS_TEMPERATURE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * num_chunks
    lanes = tl.arange(0, BLOCK)

    # The stream's uniform: splitmix64 of (key, counter) on unsigned 64-bit lanes.
    x = tl.load(key_ptr + row).to(tl.uint64, bitcast=True)
    x = x ^ (tl.load(counter_ptr + row).to(tl.uint64, bitcast=True) * _GOLDEN)
    x = (x ^ (x >> 30)) * _MIX1
    x = (x ^ (x >> 27)) * _MIX2
    x = x ^ (x >> 31)
    u = (x >> 11).to(tl.float64) * 1.1102230246251565e-16  # 2**-53

    row_max = tl.full((), float("-inf"), tl.float32)
    for start in range(0, num_chunks, BLOCK):
        idx = start + lanes
        cmax = tl.load(cmax_ptr + base + idx, mask=idx < num_chunks, other=float("-inf"))
        row_max = tl.maximum(row_max, tl.max(cmax, axis=0))

    # Total mass, the last chunk that has any, and the first chunk holding the row max.
    total = tl.full((), 0.0, tl.float64)
    last = tl.full((), -1, tl.int32)
    first_max = tl.full((), 0, tl.int32) + num_chunks - 1  # (a tensor even if num_chunks == 1)
    for start in range(0, num_chunks, BLOCK):
        idx = start + lanes
        cmax, mass = _chunk_masses(cmax_ptr, csum_ptr, base, idx, num_chunks, row_max,
                                   LIBDEVICE_EXP)
        total = tl.maximum(total, tl.max(total + tl.cumsum(mass, axis=0), axis=0))
        last = tl.maximum(last, tl.max(tl.where(mass > 0, idx, -1), axis=0))
        first_max = tl.minimum(first_max, tl.min(tl.where(cmax == row_max, idx, num_chunks),
                                                 axis=0))

    # The uniform's chunk: how many running sums (before the last massive chunk) it passes.
    target = u * total
    running = tl.full((), 0.0, tl.float64)
    which = tl.full((), 0, tl.int32)
    before = tl.full((), 0.0, tl.float64)
    for start in range(0, num_chunks, BLOCK):
        idx = start + lanes
        _, mass = _chunk_masses(cmax_ptr, csum_ptr, base, idx, num_chunks, row_max,
                                LIBDEVICE_EXP)
        cum = running + tl.cumsum(mass, axis=0)
        passed = (cum <= target) & (idx < last)
        which += tl.sum(passed.to(tl.int32), axis=0)
        before = tl.maximum(before, tl.max(tl.where(passed, cum, 0.0), axis=0))
        running = tl.maximum(running, tl.max(cum, axis=0))

    t = _row_temperature(temperature_ptr, row, HAS_TEMPERATURE)
    greedy = (t > 0) == 0  # as the twin's `~(t > 0)`: a NaN temperature is greedy too
    t = tl.where(greedy, 1.0, t)
    which = tl.where(greedy, first_max, which)

    # Inside the chunk: the token whose running weight passes the rest of the target.
    offs = tl.arange(0, CHUNK)
    cols = which * CHUNK + offs
    xs = _scaled_logits(logits_ptr, row * stride_row, cols, cols < vocab, t)
    cm = tl.load(cmax_ptr + base + which)
    inside = tl.cumsum(_exp(xs - tl.where(cm == float("-inf"), 0.0, cm), LIBDEVICE_EXP)
                       .to(tl.float64), axis=0)
    scale = _exp(cm.to(tl.float64) - row_max.to(tl.float64), LIBDEVICE_EXP)
    inside_total = tl.max(inside, axis=0)
    # Stay below the chunk's own total (its tree-ordered sum may round apart from this one).
    rest = tl.minimum((target - before) / scale, inside_total - inside_total * _BELOW_ONE)
    offset = tl.minimum(tl.sum((inside <= rest).to(tl.int32), axis=0), CHUNK - 1)
    greedy_offset = tl.minimum(tl.min(tl.where(xs == row_max, offs, CHUNK), axis=0), CHUNK - 1)
    token = which.to(tl.int64) * CHUNK + tl.where(greedy, greedy_offset, offset)
    tl.store(out_ptr + row, token)


def sample_tokens(logits: Tensor, rng_key: Tensor, rng_counter: Tensor,
                  temperature: Tensor | None = None) -> Tensor:
    """Triton twin of `reference.sample_tokens` (same arguments and result; `ops` checks them)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, SAMPLE_CHUNK)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    cmax = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    csum = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    # Fewer chunks per program for a small batch, so even one row spreads over the GPU.
    per_prog = 8 if rows <= 8 else 32
    has_t = temperature is not None
    t = temperature if has_t else cmax  # never read without HAS_TEMPERATURE
    _chunk_stats_kernel[(rows, triton.cdiv(num_chunks, per_prog))](
        logits, t, cmax, csum, logits.stride(0), vocab, num_chunks,
        HAS_TEMPERATURE=has_t, CHUNK=SAMPLE_CHUNK, CHUNKS_PER_PROG=per_prog,
        LIBDEVICE_EXP=_LIBDEVICE_EXP, num_warps=4)
    _pick_kernel[(rows,)](
        logits, t, rng_key, rng_counter, cmax, csum, out, logits.stride(0), vocab, num_chunks,
        HAS_TEMPERATURE=has_t, CHUNK=SAMPLE_CHUNK, BLOCK=_PICK_BLOCK,
        LIBDEVICE_EXP=_LIBDEVICE_EXP, num_warps=4)
    return out
