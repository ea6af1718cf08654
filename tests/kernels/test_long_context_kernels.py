"""The kernels at the last positions of a 128k-token sequence (Qwen3 with YaRN: 4 x 32,768):
the prologue reads the YaRN table's last rows and stores K/V at the sequence's last slots, and
decode attention reads its whole 8,192-entry block table. Only the index math is at full size:
one KV head of 8 dims, two query tokens, no 128k forward pass."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import INTERPRETER_ONLY

import kernels

CONTEXT = 4 * 32768
BLOCK = 16
BLOCKS = CONTEXT // BLOCK
YARN = {"factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=INTERPRETER_ONLY)])
def test_last_positions_of_a_128k_sequence(backend: str) -> None:
    """The prologue reads the YaRN table's last rows and stores K/V at the sequence's last
    slots; decode attention at positions 65,536 and 131,071 reads the whole 8,192-entry block
    table (ids permuted) and equals attention over the keys in order."""
    heads, dim = 1, 8
    gen = torch.Generator().manual_seed(0)
    cos_sin = kernels.compute_cos_sin_cache(dim, CONTEXT, 1_000_000.0, YARN)
    perm = torch.randperm(BLOCKS + 8, generator=gen)[:BLOCKS].to(torch.int32)
    k_cache = torch.randn(BLOCKS + 8, BLOCK, heads, dim, generator=gen)
    v_cache = torch.randn(BLOCKS + 8, BLOCK, heads, dim, generator=gen)
    positions = torch.tensor([CONTEXT // 2, CONTEXT - 1])
    slots = (perm[positions // BLOCK].long() * BLOCK + positions % BLOCK)
    qkv = torch.randn(2, 3 * heads * dim, generator=gen)
    ones = torch.ones(dim)
    want_qkv = qkv.clone()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kernels.qk_norm_rope_write_kv(want_qkv, heads, heads, ones, ones, 1e-6, positions, cos_sin,
                                  want_k, want_v, slots, backend="torch")
    q, k, v = kernels.qk_norm_rope_write_kv(qkv, heads, heads, ones, ones, 1e-6, positions,
                                            cos_sin, k_cache, v_cache, slots, backend=backend)
    torch.testing.assert_close(qkv, want_qkv, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(k_cache, want_k, rtol=2e-5, atol=2e-5)
    assert torch.equal(v_cache, want_v)
    lens = positions + 1
    out = kernels.paged_attention(
        q.contiguous(), k_cache, v_cache, perm.repeat(2, 1), torch.tensor([0, 1, 2], dtype=torch.int32),
        lens.to(torch.int32), dim ** -0.5, 1, CONTEXT, backend=backend)
    keys, values = k_cache[perm.long()].flatten(0, 1), v_cache[perm.long()].flatten(0, 1)
    for i, n in enumerate(lens.tolist()):
        weights = torch.softmax((keys[:n, 0] @ q[i, 0]) * dim ** -0.5, dim=0)
        torch.testing.assert_close(out[i, 0], weights @ values[:n, 0], rtol=1e-4, atol=1e-5)
