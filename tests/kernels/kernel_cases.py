"""Shared cases for the Triton-vs-reference tests, run on CPU (interpreter) and on CUDA.

A paged batch is built so that any read the contract forbids shows up as NaN in the output:
blocks no sequence uses ("holes"), block-table padding entries, and the slots past each
sequence's length inside its last block are all filled with NaN.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import Tensor


def load_launch_counter() -> ModuleType:
    """bench/launch_counter.py as a module (the launch counter and the decode-layer builder)."""
    name = "launch_counter"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "bench" / "launch_counter.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def run_sm90_compile(script: str, cache_dir: Path) -> None:
    """Run tests/kernels/`script` (an sm_90 compile of Triton kernels, no GPU needed) in a
    process without TRITON_INTERPRET and a cold Triton cache; asserts it compiled."""
    import subprocess

    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1]), str(here)])
    result = subprocess.run([sys.executable, str(here / script)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("compiled for sm_90")


# CPU cases run only under Triton's interpreter (conftest sets TRITON_INTERPRET=1 without CUDA).
INTERPRETER_ONLY = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors need Triton's interpreter, which is off when CUDA is present; "
           "test_kernels_triton_gpu.py runs these cases on the GPU")

# Tolerances (atol = rtol) per dtype: fp32 is exact arithmetic up to summation order; fp16/bf16
# allow two units in the last place at |x| ~ 1 (the kernel rounds P to the input dtype before
# P @ V, as flash attention does; the reference rounds once at the end).
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass(slots=True)
class PagedBatch:
    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    block_tables: Tensor
    query_start_loc: Tensor
    seq_lens: Tensor
    max_query_len: int
    max_seq_len: int
    scale: float


def make_paged_batch(q_and_seq_lens: list[tuple[int, int]], *, num_q_heads: int, num_kv_heads: int,
                     head_dim: int, block_size: int, dtype: torch.dtype, device: str,
                     share_first_block: bool = False, seed: int = 0) -> PagedBatch:
    """A batch whose sequence b has query length q_lens[b] and seq_len seq_lens[b].

    Physical blocks are a random permutation of a pool twice as large as needed (holes between
    them); with `share_first_block` every sequence's first block is the same physical block
    (prefix reuse). Table rows are padded to the longest sequence with a NaN-filled block id.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-s // block_size) for _, s in q_and_seq_lens]
    num_blocks = 2 * sum(blocks_needed) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_needed) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    nan_block = perm.pop()
    table = torch.full((len(q_and_seq_lens), max_blocks), nan_block, dtype=torch.int32)
    shared = perm.pop() if share_first_block else None
    for b, (_, seq_len) in enumerate(q_and_seq_lens):
        for i in range(blocks_needed[b]):
            block = shared if (i == 0 and shared is not None) else perm.pop()
            table[b, i] = block
            rows = min(block_size, seq_len - i * block_size)
            k_cache[block, :rows] = torch.randn(rows, num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[block, :rows] = torch.randn(rows, num_kv_heads, head_dim, generator=gen).to(dtype)
    q_lens = [q for q, _ in q_and_seq_lens]
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    q = torch.randn(starts[-1], num_q_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        q=q.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        block_tables=table.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for _, s in q_and_seq_lens], dtype=torch.int32, device=device),
        max_query_len=max(q_lens), max_seq_len=max(s for _, s in q_and_seq_lens),
        scale=head_dim ** -0.5,
    )


def chunk_kv(batch: PagedBatch) -> tuple[Tensor, Tensor]:
    """This step's K/V rows `[T, Hkv, D]`, read back from the cache at each query's position.

    They are views into one wider tensor (as K and V are of a fused QKV projection), with the
    columns between them filled with NaN, so a read past a row's own head shows up.
    """
    from kernels import reference

    t = batch.q.shape[0]
    _, _, num_kv_heads, head_dim = batch.k_cache.shape
    width = num_kv_heads * head_dim
    qkv = torch.full((t, 3 * width), float("nan"), dtype=batch.q.dtype, device=batch.q.device)
    starts = batch.query_start_loc.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = starts[b + 1] - starts[b]
        for col, cache in ((0, batch.k_cache), (2 * width, batch.v_cache)):
            rows = reference.gather_kv(cache, batch.block_tables[b], seq_len)[seq_len - q_len:]
            qkv[starts[b]:starts[b + 1], col:col + width] = rows.reshape(q_len, width)
    return (qkv[:, :width].view(t, num_kv_heads, head_dim),
            qkv[:, 2 * width:].view(t, num_kv_heads, head_dim))


def check_paged_attention(batch: PagedBatch, *, with_chunk_kv: bool = False,
                          **triton_kwargs: int | bool) -> None:
    """The Triton kernel equals the reference; with `with_chunk_kv` it reads each chunk's own
    keys from `chunk_kv(batch)`, and the cache slots of this step's tokens hold NaN so that a
    read of them through the block table shows up."""
    from kernels import reference
    from kernels.triton_attention import paged_attention

    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
            batch.seq_lens, batch.scale)
    expected = reference.paged_attention(*args)
    if with_chunk_kv:
        key, value = chunk_kv(batch)
        k_cache, v_cache = _poison_chunk_slots(batch)
        args = (batch.q, k_cache, v_cache, *args[3:])
        got = paged_attention(*args, batch.max_query_len, batch.max_seq_len, key, value,
                              **triton_kwargs)
    else:
        got = paged_attention(*args, batch.max_query_len, batch.max_seq_len, **triton_kwargs)
    assert got.dtype == batch.q.dtype and got.shape == batch.q.shape
    assert not got.isnan().any(), "kernel read a slot outside the sequences' blocks"
    tol = TOL[batch.q.dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def _poison_chunk_slots(batch: PagedBatch) -> tuple[Tensor, Tensor]:
    """Copies of the caches with NaN in the slots of this step's tokens (except the slots that
    another sequence reads as its cached prefix: `share_first_block` batches have them)."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    block_size = k_cache.shape[1]
    starts = batch.query_start_loc.tolist()
    seq_lens = batch.seq_lens.tolist()

    def slot(b: int, pos: int) -> tuple[int, int]:
        return int(batch.block_tables[b, pos // block_size]), pos % block_size

    ranges = [(seq_len - (starts[b + 1] - starts[b]), seq_len) for b, seq_len in enumerate(seq_lens)]
    prefix = {slot(b, pos) for b, (ctx, _) in enumerate(ranges) for pos in range(ctx)}
    for b, (ctx, seq_len) in enumerate(ranges):
        for pos in range(ctx, seq_len):
            if slot(b, pos) not in prefix:
                k_cache[slot(b, pos)] = float("nan")
                v_cache[slot(b, pos)] = float("nan")
    return k_cache, v_cache


# (q_len, seq_len) lists. Block size 4 in the CPU tests, so these end mid-block.
DECODE = [(1, 1), (1, 6), (1, 17), (1, 40)]
MIXED = [(5, 5), (3, 11), (1, 22), (6, 30), (1, 3)]
PREFILL = [(37, 37), (20, 61), (1, 9), (33, 50)]


# Block size 4: slots 21, 23 -> block 5; 3, 0 -> block 0; 4 -> block 1; -1 = padding.
# Blocks 2, 3 and 4 are reached by no slot.
SLOTS = [21, -1, 3, 4, 23, -1, 0]
UNREACHED_BLOCKS = [2, 3, 4]


def _assert_only_slots_written(cache: Tensor, before: Tensor, slots: list[int]) -> None:
    """Every cache row outside `slots` (and every row of UNREACHED_BLOCKS) equals `before`."""
    flat, flat_before = cache.flatten(0, 1), before.flatten(0, 1)
    keep = torch.ones(flat.shape[0], dtype=torch.bool)
    keep[[s for s in slots if s >= 0]] = False
    assert torch.equal(flat[keep], flat_before[keep])
    assert torch.equal(cache[UNREACHED_BLOCKS], before[UNREACHED_BLOCKS])


def check_write_kv(device: str, dtype: torch.dtype) -> None:
    """Exact scatter: -1 slots skipped, every other cache slot untouched, last-dim-strided input."""
    from kernels import reference
    from kernels.triton_kv import write_kv

    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 16
    k_before = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_before = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # K and V as views into one fused projection, the way a QKV matmul produces them.
    kv = torch.randn(7, 2 * num_kv_heads * head_dim, generator=gen).to(dtype)
    key = kv[:, : num_kv_heads * head_dim].view(7, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim:].view(7, num_kv_heads, head_dim)
    slot_mapping = torch.tensor(SLOTS, dtype=torch.int64)
    k_ref, v_ref = k_before.clone(), v_before.clone()
    reference.write_kv(key, value, k_ref, v_ref, slot_mapping)
    # clone(): on CPU `.to("cpu")` would be k_before itself, and the kernel's writes would land
    # in the tensor the untouched blocks are compared with.
    k_dev, v_dev = k_before.clone().to(device), v_before.clone().to(device)
    write_kv(key.to(device), value.to(device), k_dev, v_dev, slot_mapping.to(device))
    assert torch.equal(k_dev.cpu(), k_ref) and torch.equal(v_dev.cpu(), v_ref)
    assert torch.equal(k_ref[5, 1], key[0]) and torch.equal(v_ref[0, 0], value[6])
    _assert_only_slots_written(k_dev.cpu(), k_before, SLOTS)
    _assert_only_slots_written(v_dev.cpu(), v_before, SLOTS)


def check_qk_norm_rope_write_kv(device: str, dtype: torch.dtype, num_q_heads: int,
                                num_kv_heads: int, head_dim: int) -> None:
    """The fused attention prologue against its torch twin: q/k normed and rotated in place in
    a row-strided qkv, V untouched, K/V at their slots, -1 skipped, every other slot untouched."""
    from kernels import reference
    from kernels.triton_fused import qk_norm_rope_write_kv

    gen = torch.Generator().manual_seed(12)
    num_tokens, num_blocks, block_size = len(SLOTS), 6, 4
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    # Rows of a wider buffer: qkv's row stride is not its width.
    qkv = (2 * torch.randn(num_tokens, width + 8, generator=gen)).to(dtype)[:, :width]
    q_weight = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype)
    k_weight = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype)
    positions = torch.tensor([7, 0, 63, 7, 30, 2, 5])
    cos_sin = reference.compute_cos_sin_cache(head_dim, 64, 10000.0)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_before = torch.randn(shape, generator=gen).to(dtype)
    v_before = torch.randn(shape, generator=gen).to(dtype)
    slot_mapping = torch.tensor(SLOTS, dtype=torch.int64)
    eps = 1e-6

    qkv_ref, k_ref, v_ref = qkv.clone(), k_before.clone(), v_before.clone()
    q_exp, k_exp, v_exp = reference.qk_norm_rope_write_kv(
        qkv_ref, num_q_heads, num_kv_heads, q_weight, k_weight, eps, positions, cos_sin,
        k_ref, v_ref, slot_mapping)
    qkv_dev = qkv.clone().to(device)
    k_dev, v_dev = k_before.clone().to(device), v_before.clone().to(device)
    q, k, v = qk_norm_rope_write_kv(qkv_dev, num_q_heads, num_kv_heads, q_weight.to(device),
                                    k_weight.to(device), eps, positions.to(device),
                                    cos_sin.to(device), k_dev, v_dev, slot_mapping.to(device))
    tol = TOL[dtype]
    assert q.data_ptr() == qkv_dev.data_ptr() and q.shape == (num_tokens, num_q_heads, head_dim)
    torch.testing.assert_close(q.cpu(), q_exp, atol=tol, rtol=tol)
    torch.testing.assert_close(k.cpu(), k_exp, atol=tol, rtol=tol)
    assert torch.equal(v.cpu(), v_exp) and torch.equal(v_exp, qkv[:, -num_kv_heads * head_dim:]
                                                       .view(num_tokens, num_kv_heads, head_dim))
    written = torch.tensor([s >= 0 for s in SLOTS])
    slots = slot_mapping[written]
    # The cache holds exactly this call's (rotated) k and v at each slot.
    assert torch.equal(k_dev.cpu().flatten(0, 1)[slots], k.cpu()[written])
    assert torch.equal(v_dev.cpu().flatten(0, 1)[slots], v.cpu()[written])
    torch.testing.assert_close(k_dev.cpu(), k_ref, atol=tol, rtol=tol)
    _assert_only_slots_written(k_dev.cpu(), k_before, SLOTS)
    _assert_only_slots_written(v_dev.cpu(), v_before, SLOTS)


def check_rms_norm(device: str, dtype: torch.dtype, shape: tuple[int, ...], residual: bool) -> None:
    from kernels import reference
    from kernels.triton_fused import rms_norm

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    res = torch.randn(shape, generator=gen).to(dtype) if residual else None
    expected = reference.rms_norm(x, weight, 1e-6, res)
    got = rms_norm(x.to(device), weight.to(device), 1e-6, None if res is None else res.to(device))
    tol = TOL[dtype]
    if residual:
        torch.testing.assert_close(got[0].cpu(), expected[0], atol=tol, rtol=tol)
        assert torch.equal(got[1].cpu(), expected[1])  # x + residual: one rounding, both sides
    else:
        torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=tol)


def check_rotary(device: str, dtype: torch.dtype) -> None:
    """In place on q/k views of one fused QKV tensor; positions unsorted and repeated."""
    from kernels import reference
    from kernels.triton_fused import rotary_embedding

    gen = torch.Generator().manual_seed(3)
    num_tokens, num_q_heads, num_kv_heads, head_dim = 5, 4, 2, 16
    cache = reference.compute_cos_sin_cache(head_dim, 64, 10000.0)
    positions = torch.tensor([7, 0, 63, 7, 30])
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype)
    q_ref = qkv[:, : num_q_heads * head_dim].reshape(num_tokens, num_q_heads, head_dim).clone()
    k_ref = qkv[:, num_q_heads * head_dim: (num_q_heads + num_kv_heads) * head_dim]
    k_ref = k_ref.reshape(num_tokens, num_kv_heads, head_dim).clone()
    reference.rotary_embedding(positions, q_ref, k_ref, cache)
    qkv_dev = qkv.to(device)
    q = qkv_dev[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv_dev[:, num_q_heads * head_dim: (num_q_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    q_out, k_out = rotary_embedding(positions.to(device), q, k, cache.to(device))
    assert q_out is q and k_out is k
    tol = TOL[dtype]
    torch.testing.assert_close(q.cpu(), q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k.cpu(), k_ref, atol=tol, rtol=tol)
    v_cols = slice((num_q_heads + num_kv_heads) * head_dim, None)
    assert torch.equal(qkv_dev[:, v_cols].cpu(), qkv[:, v_cols])  # V untouched


def check_silu_and_mul(device: str, dtype: torch.dtype) -> None:
    from kernels import reference
    from kernels.triton_fused import silu_and_mul

    gen = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(3, 2, 2 * 40, generator=gen)).to(dtype)
    got = silu_and_mul(x.to(device))
    assert got.shape == (3, 2, 40)
    tol = TOL[dtype]
    torch.testing.assert_close(got.cpu(), reference.silu_and_mul(x), atol=tol, rtol=tol)
