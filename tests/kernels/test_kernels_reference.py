"""The torch references are bit-identical to Hugging Face Qwen3 in fp32, and ops dispatches right."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config
from transformers.models.qwen3 import modeling_qwen3 as hf

import kernels
from kernels import reference


class _EagerModule:
    """What `eager_attention_forward` reads off its module argument."""

    def __init__(self, groups: int) -> None:
        self.num_key_value_groups = groups
        self.training = False


def test_rms_norm_is_bit_identical_to_hf_with_and_without_residual() -> None:
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 6, 64, generator=gen), torch.randn(2, 6, 64, generator=gen)
    norm = hf.Qwen3RMSNorm(64, eps=1e-6)
    norm.weight.data = torch.randn(64, generator=gen)
    assert torch.equal(kernels.rms_norm(x, norm.weight.data, 1e-6), norm(x))
    out, new_residual = kernels.rms_norm(x, norm.weight.data, 1e-6, residual)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(out, norm(residual + x))


def test_rotary_embedding_is_bit_identical_to_hf_and_in_place() -> None:
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=128, rope_theta=1_000_000.0)
    rope = hf.Qwen3RotaryEmbedding(config)
    gen = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 1, 9, 127, 64])
    q, k = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    cos, sin = rope(q, positions[None])
    q_hf, k_hf = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = kernels.compute_cos_sin_cache(16, 128, 1_000_000.0)
    q_out, k_out = kernels.rotary_embedding(positions, q, k, cache)
    assert q_out is q and k_out is k
    assert torch.equal(q, q_hf[0].transpose(0, 1)) and torch.equal(k, k_hf[0].transpose(0, 1))


def test_qk_norm_rope_write_kv_is_bit_identical_to_hf_attention_prologue() -> None:
    """q_norm, k_norm and rotary as HF's Qwen3Attention runs them, in place in the packed qkv,
    and K/V stored at their slots."""
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=128, rope_theta=1_000_000.0)
    gen = torch.Generator().manual_seed(5)
    q_norm, k_norm = hf.Qwen3RMSNorm(16, eps=1e-6), hf.Qwen3RMSNorm(16, eps=1e-6)
    q_norm.weight.data = torch.randn(16, generator=gen)
    k_norm.weight.data = torch.randn(16, generator=gen)
    qkv = torch.randn(3, (4 + 2 * 2) * 16, generator=gen)
    positions = torch.tensor([9, 0, 127])
    cos, sin = hf.Qwen3RotaryEmbedding(config)(qkv, positions[None])
    q_hf = q_norm(qkv[:, :64].view(3, 4, 16)).transpose(0, 1)[None]
    k_hf = k_norm(qkv[:, 64:96].view(3, 2, 16)).transpose(0, 1)[None]
    q_hf, k_hf = hf.apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
    v_before = qkv[:, 96:].clone()
    k_cache, v_cache = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    q, k, v = kernels.qk_norm_rope_write_kv(
        qkv, 4, 2, q_norm.weight.data, k_norm.weight.data, 1e-6, positions,
        kernels.compute_cos_sin_cache(16, 128, 1_000_000.0), k_cache, v_cache,
        torch.tensor([5, -1, 0]))
    assert q.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(q, q_hf[0].transpose(0, 1)) and torch.equal(k, k_hf[0].transpose(0, 1))
    assert torch.equal(v, v_before.view(3, 2, 16))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[0, 0], v[2])
    assert torch.equal(k_cache.flatten(0, 1)[[1, 2, 3, 4, 6, 7]], torch.zeros(6, 2, 16))


def test_cos_sin_cache_layout() -> None:
    cache = kernels.compute_cos_sin_cache(8, 3, 10000.0)
    assert cache.shape == (3, 8) and cache.dtype == torch.float32
    assert torch.equal(cache[0], torch.tensor([1.0] * 4 + [0.0] * 4))
    assert cache[2, 0].item() == pytest.approx(torch.tensor(2.0).cos().item())
    assert cache[2, 5].item() == pytest.approx(torch.tensor(2.0 / 10000 ** 0.25).sin().item())


def test_silu_and_mul_is_bit_identical_to_hf_mlp_activation() -> None:
    gen = torch.Generator().manual_seed(2)
    gate, up = torch.randn(4, 24, generator=gen), torch.randn(4, 24, generator=gen)
    # The merged gate_up projection hands over a strided view; HF applies SiLU to a fresh tensor.
    assert torch.equal(kernels.silu_and_mul(torch.cat([gate, up], dim=-1)), F.silu(gate) * up)


def test_paged_prefill_then_decode_is_bit_identical_to_hf_eager_attention() -> None:
    """A 7-token prompt written to scattered blocks, then one decode step, against HF eager."""
    gen = torch.Generator().manual_seed(3)
    num_q_heads, num_kv_heads, head_dim, block_size, scale = 4, 2, 16, 4, 0.25
    q = torch.randn(8, num_q_heads, head_dim, generator=gen)
    k = torch.randn(8, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(8, num_kv_heads, head_dim, generator=gen)
    k_cache = torch.zeros(6, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.tensor([[5, 2, 0]], dtype=torch.int32)  # entry 2 is padding
    slots = torch.tensor([20, 21, 22, 23, 8, 9, 10, 11])

    def hf_eager(q_rows: slice, num_keys: int) -> torch.Tensor:
        # What HF runs: the whole prompt with a causal mask, then one query row over the cache.
        q_len = q_rows.stop - q_rows.start
        mask = None
        if q_len > 1:
            mask = torch.full((q_len, q_len), torch.finfo(torch.float32).min).triu(1)[None, None]
        out, _ = hf.eager_attention_forward(
            _EagerModule(2), q[q_rows].transpose(0, 1)[None],
            k[:num_keys].transpose(0, 1)[None], v[:num_keys].transpose(0, 1)[None], mask, scale)
        return out[0]

    kernels.write_kv(k[:7], v[:7], k_cache, v_cache, slots[:7])
    prefill = kernels.paged_attention(q[:7], k_cache, v_cache, block_table,
                                      torch.tensor([0, 7], dtype=torch.int32),
                                      torch.tensor([7], dtype=torch.int32), scale, 7, 7, backend="torch")
    assert torch.equal(prefill, hf_eager(slice(0, 7), 7))
    kernels.write_kv(k[7:], v[7:], k_cache, v_cache, slots[7:])
    decode = kernels.paged_attention(q[7:], k_cache, v_cache, block_table,
                                     torch.tensor([0, 1], dtype=torch.int32),
                                     torch.tensor([8], dtype=torch.int32), scale, 1, 8, backend="torch")
    assert torch.equal(decode, hf_eager(slice(7, 8), 8))


def test_mixed_batch_matches_sdpa_per_sequence() -> None:
    """Chunked prefill with a cached prefix and a decode in one batch, GQA 4, vs torch SDPA."""
    gen = torch.Generator().manual_seed(4)
    num_q_heads, num_kv_heads, head_dim, block_size = 8, 2, 16, 4
    lens = [(3, 10), (1, 6)]  # (q_len, seq_len)
    k_cache = torch.randn(8, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(8, block_size, num_kv_heads, head_dim, generator=gen)
    block_tables = torch.tensor([[7, 1, 4], [2, 5, 0]], dtype=torch.int32)
    q = torch.randn(4, num_q_heads, head_dim, generator=gen)
    out = kernels.paged_attention(q, k_cache, v_cache, block_tables,
                                  torch.tensor([0, 3, 4], dtype=torch.int32),
                                  torch.tensor([10, 6], dtype=torch.int32), 0.3, 3, 10)
    q_start = 0
    for b, (q_len, seq_len) in enumerate(lens):
        k = reference.gather_kv(k_cache, block_tables[b], seq_len).transpose(0, 1)
        v = reference.gather_kv(v_cache, block_tables[b], seq_len).transpose(0, 1)
        visible = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
        expected = F.scaled_dot_product_attention(
            q[q_start:q_start + q_len].transpose(0, 1), k, v, attn_mask=visible, scale=0.3,
            enable_gqa=True)
        torch.testing.assert_close(out[q_start:q_start + q_len], expected.transpose(0, 1),
                                   atol=1e-6, rtol=1e-6)
        q_start += q_len


def test_write_kv_reference_skips_padding_slots() -> None:
    k_cache = torch.zeros(2, 2, 1, 2)
    v_cache = torch.zeros(2, 2, 1, 2)
    key = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]])
    kernels.write_kv(key, -key, k_cache, v_cache, torch.tensor([3, -1, 0]))
    assert k_cache.flatten().tolist() == [5.0, 6.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0]
    assert v_cache.flatten().tolist() == [-5.0, -6.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0]


def test_split_k_choice_follows_the_h100_measurements() -> None:
    from kernels.attention_split import choose_num_segments

    # Qwen3-0.6B decode (8 KV heads) on a 132-SM H100: the fastest factor measured in a CUDA
    # graph (shared/gpu/h100-2026-11-22/attn_sweep.json, kernels.json).
    assert choose_num_segments(1, 8, 1, 1024, 64, 132) == 16  # 6.5 us; the old choice, 4: 11.2
    assert choose_num_segments(1, 8, 1, 2048, 64, 132) == 16
    assert choose_num_segments(1, 8, 1, 512, 64, 132) == 8
    assert choose_num_segments(1, 8, 1, 32768, 64, 132) == 16
    assert choose_num_segments(1, 8, 1, 128, 64, 132) == 1
    assert choose_num_segments(32, 8, 1, 1024, 64, 132) == 2
    assert choose_num_segments(32, 8, 1, 128, 64, 132) == 1
    assert choose_num_segments(128, 8, 1, 1024, 64, 132) == 1
    assert choose_num_segments(256, 8, 1, 32768, 64, 132) == 1
    # Never more segments than key tiles; prefill never splits.
    assert choose_num_segments(1, 8, 1, 300, 64, 132) == 4  # 5 tiles: 8 rounded down to 4
    assert choose_num_segments(1, 8, 16, 32768, 64, 132) == 1


def test_unknown_backend_is_rejected_with_the_choices() -> None:
    with pytest.raises(ValueError, match="must be one of"):
        kernels.silu_and_mul(torch.zeros(1, 4), backend="cuda")  # type: ignore[arg-type]


def test_flash_attn_backend_only_for_attention() -> None:
    with pytest.raises(ValueError, match="only for paged_attention"):
        kernels.rms_norm(torch.zeros(2, 4), torch.ones(4), 1e-6, backend="flash_attn")


def test_flash_attn_backend_says_it_is_not_importable() -> None:
    q = torch.zeros(1, 2, 8)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="not importable"):
        kernels.paged_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                torch.tensor([0, 1], dtype=torch.int32),
                                torch.tensor([1], dtype=torch.int32), 1.0, 1, 1,
                                backend="flash_attn")


@pytest.mark.parametrize(("q_shape", "match"), [
    ((1, 3, 8), "multiple of the cache's KV heads"),
    ((1, 2, 4), "head_dim must match"),
])
def test_paged_attention_rejects_mismatched_heads(q_shape: tuple[int, ...], match: str) -> None:
    cache = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match=match):
        kernels.paged_attention(torch.zeros(q_shape), cache, cache,
                                torch.zeros(1, 1, dtype=torch.int32),
                                torch.tensor([0, 1], dtype=torch.int32),
                                torch.tensor([1], dtype=torch.int32), 1.0, 1, 1)


def test_write_kv_rejects_key_shape_that_does_not_match_cache() -> None:
    cache = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match=r"key/value must be \[T, 2, 8\]"):
        kernels.write_kv(torch.zeros(3, 1, 8), torch.zeros(3, 1, 8), cache, cache,
                         torch.zeros(3, dtype=torch.int64))


def test_auto_backend_uses_reference_on_cpu_for_small_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(3, 8)
    assert torch.equal(kernels.silu_and_mul(x), reference.silu_and_mul(x))
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        kernels.silu_and_mul(x, backend="triton")


@pytest.mark.parametrize("chunk_elements", [1 << 24, 1])
def test_batched_decode_path_matches_per_sequence_attention(
        monkeypatch: pytest.MonkeyPatch, chunk_elements: int) -> None:
    """The CPU decode fast path (all single-token rows at once, padded, chunked) against the
    per-sequence eager computation, on a NaN-poisoned cache with a prefill chunk in between."""
    from kernel_cases import make_paged_batch

    monkeypatch.setattr(reference, "_DECODE_CHUNK_ELEMENTS", chunk_elements)
    lens = [(1, 9), (1, 1), (1, 33), (5, 12), (1, 16), (1, 17)]
    batch = make_paged_batch(lens, num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=4,
                             dtype=torch.float32, device="cpu", share_first_block=True, seed=5)
    out = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                    batch.query_start_loc, batch.seq_lens, 0.25)
    assert not out.isnan().any()
    starts = batch.query_start_loc.tolist()
    for b, (_, seq_len) in enumerate(lens):
        rows = slice(starts[b], starts[b + 1])
        expected = reference._sequence_attention(batch.q[rows], batch.k_cache, batch.v_cache,
                                                 batch.block_tables[b], seq_len, 0.25)
        torch.testing.assert_close(out[rows], expected, atol=1e-6, rtol=1e-6)
