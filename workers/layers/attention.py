"""Paged attention over one layer's KV cache, driven by an explicit `AttentionMetadata`.

The metadata is built once per step by the model runner (or is the static buffers of a
captured CUDA graph) and passed down through every layer's forward: no layer reads global
state. Each `Attention` holds views of its layer's K and V in the stacked cache tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

import kernels


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what each query attends.

    Tokens of sequence b are rows query_start_loc[b]:query_start_loc[b+1] of the batch;
    seq_lens[b] counts the sequence's cached tokens including this step's. slot_mapping[t]
    is block_id * block_size + offset for token t (-1 = padding, not written).
    `max_query_len` / `max_seq_len` are host-side upper bounds (no device sync).
    `step_cache` holds what a kernel derives from these tensors once for every layer (the CPU
    attention's decode plan); it lives and dies with this metadata, which must not change
    after the first layer has read it.
    """

    slot_mapping: Tensor  # int64 [T]
    block_tables: Tensor  # int32 [B, max_blocks]
    query_start_loc: Tensor  # int32 [B + 1]
    seq_lens: Tensor  # int32 [B]
    max_query_len: int
    max_seq_len: int
    step_cache: dict = field(default_factory=dict)


@dataclass(slots=True)
class OutputRows:
    """The rows whose final hidden states a step uses (the sampled rows, in sampling order),
    when fewer than its tokens: the model's last layer computes only these after storing every
    token's K/V (workers/qwen3.py). `metadata` attends each kept row as a one-token query at its
    own position (`seq_lens` = position + 1, its sequence's block table): a decode batch,
    reading the cache the layer has just written."""

    rows: Tensor  # int64 [S] token rows of the step
    metadata: AttentionMetadata


class Attention(nn.Module):
    """Attends this step's queries over the paged cache of one layer.

    This step's K/V must already be in the cache (`kernels.qk_norm_rope_write_kv` stores them);
    `k`/`v` are the same rows, from which the kernel reads each chunk's own keys contiguously.
    `k_scale` / `v_scale` (float32 `[num_kv_heads]`, this rank's KV heads, 1.0) are the
    per-head scales an FP8 cache (kv_cache_dtype fp8) stores its values divided by (a
    per-tensor scale fills the vector); a full-precision cache ignores them.
    workers/kv_scales.py sets them (the checkpoint's, or `calculate_kv_scales` while
    `kv_scales_pending`).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: str = "auto") -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        # Bound to views of the stacked cache by CacheEngine; empty until then.
        self.k_cache = torch.tensor([])
        self.v_cache = torch.tensor([])
        self.register_buffer("k_scale", torch.ones(num_kv_heads, dtype=torch.float32),
                             persistent=False)
        self.register_buffer("v_scale", torch.ones(num_kv_heads, dtype=torch.float32),
                             persistent=False)
        self.kv_scales_pending = False
        self.kv_scales_calculated = False

    def kv_cache(self) -> tuple[Tensor, Tensor]:
        """This layer's (k_cache, v_cache) `[num_blocks, block_size, Hkv, D]`."""
        if self.k_cache.dim() != 4:
            raise RuntimeError("the KV cache is not allocated; call Worker.init_cache first")
        return self.k_cache, self.v_cache

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attn_metadata: AttentionMetadata,
                out: OutputRows | None = None) -> Tensor:
        """`q`/`k`/`v`: the step's rows (`k`/`v` as stored); with `out`, only its rows attend
        (`[S, Hq, D]`), each a one-token query whose own key is its row of `k`."""
        k_cache, v_cache = self.kv_cache()
        md = attn_metadata
        if out is not None:
            q, k, v, md = q[out.rows], k[out.rows], v[out.rows], out.metadata
        return kernels.paged_attention(q, k_cache, v_cache, md.block_tables,
                                       md.query_start_loc, md.seq_lens, self.scale,
                                       md.max_query_len, md.max_seq_len, backend=self.backend,
                                       key=k, value=v, k_scale=self.k_scale,
                                       v_scale=self.v_scale, step_cache=md.step_cache)
