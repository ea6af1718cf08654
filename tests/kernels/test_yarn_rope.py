"""YaRN's rotary table equals transformers' `Qwen3RotaryEmbedding` with rope_type yarn: the
frequencies of `_compute_yarn_parameters` and cos/sin times its attention factor, for the
parameter spellings Qwen3 and other YaRN checkpoints use."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3 import modeling_qwen3 as hf

import kernels

YARN_CASES = [
    {"factor": 4.0, "original_max_position_embeddings": 32},  # Qwen3's documented form
    {"factor": 2.5, "original_max_position_embeddings": 48, "beta_fast": 16, "beta_slow": 2},
    {"factor": 4.0, "original_max_position_embeddings": 32, "attention_factor": 0.9},
    {"factor": 8.0, "original_max_position_embeddings": 16, "mscale": 1.0,
     "mscale_all_dim": 0.5, "truncate": False},
]


@pytest.mark.parametrize("yarn", YARN_CASES)
def test_yarn_table_is_bit_identical_to_transformers(yarn: dict) -> None:
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=128,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **yarn})
    rope = hf.Qwen3RotaryEmbedding(config)
    positions = torch.arange(128)
    cos, sin = rope(torch.zeros(1, 128, 16), positions[None])
    table = kernels.compute_cos_sin_cache(16, 128, 10000.0, yarn)
    assert torch.equal(torch.cat((table[:, :8], table[:, :8]), -1), cos[0])
    assert torch.equal(torch.cat((table[:, 8:], table[:, 8:]), -1), sin[0])
    # and the rotation applied with it, past the original context
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(128, 4, 16, generator=gen), torch.randn(128, 2, 16, generator=gen)
    q_hf, k_hf = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         cos, sin)
    kernels.rotary_embedding(positions, q, k, table)
    assert torch.equal(q, q_hf[0].transpose(0, 1)) and torch.equal(k, k_hf[0].transpose(0, 1))


def test_yarn_scales_cos_sin_by_its_attention_factor() -> None:
    # factor 4: 0.1 ln 4 + 1; the highest-frequency pair keeps plain RoPE's angle.
    plain = kernels.compute_cos_sin_cache(16, 64, 10000.0)
    yarn = kernels.compute_cos_sin_cache(16, 64, 10000.0,
                                         {"factor": 4.0, "original_max_position_embeddings": 32})
    scale = 0.1 * torch.log(torch.tensor(4.0)).item() + 1.0
    torch.testing.assert_close(yarn[:, 0], plain[:, 0] * scale, rtol=1e-6, atol=0)
    assert not torch.allclose(yarn[:, 7], plain[:, 7] * scale)  # the lowest is interpolated
