"""The KV cache of one rank: a stacked device tensor plus a CPU swap space of the same layout.

Layout `[2 (K, V), num_layers, num_blocks, block_size, num_kv_heads, head_dim]`: block `b`
of every layer is `cache[:, :, b]`, so a plan's swap-out, swap-in or copy-on-write pairs move
every layer's K and V with one `index_select` + one `index_copy_` per direction.
Each attention layer gets the views `cache[0, i]` / `cache[1, i]` (what the kernels take).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from workers.layers.attention import Attention


class CacheEngine:
    """Owns the device KV blocks and the CPU swap blocks; ids are the scheduler's block ids."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_gpu_blocks: int, num_cpu_blocks: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1; got {num_gpu_blocks}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0; got {num_cpu_blocks}")
        self.device = device
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        shape = (2, num_layers, num_gpu_blocks, block_size, num_kv_heads, head_dim)
        # CUDA: zeros, so the padded rows of a CUDA-graph batch only ever read finite values.
        # CPU: empty, so untouched blocks cost no memory (every read block was written first).
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        self.gpu_cache = alloc(shape, dtype=dtype, device=device)
        cpu_shape = (2, num_layers, num_cpu_blocks, block_size, num_kv_heads, head_dim)
        self.cpu_cache = torch.empty(cpu_shape, dtype=dtype, device="cpu",
                                     pin_memory=device.type == "cuda" and num_cpu_blocks > 0)

    def bind(self, layers: list[Attention]) -> None:
        """Point every attention layer at its slice of the stacked cache."""
        if len(layers) != self.gpu_cache.shape[1]:
            raise ValueError(f"cache has {self.gpu_cache.shape[1]} layers, model {len(layers)}")
        for i, attn in enumerate(layers):
            attn.k_cache = self.gpu_cache[0, i]
            attn.v_cache = self.gpu_cache[1, i]

    def _ids(self, pairs: np.ndarray, column: int, limit: int, what: str,
             device: torch.device) -> Tensor:
        ids = pairs[:, column]
        if ids.min() < 0 or ids.max() >= limit:
            raise ValueError(f"{what} block id out of range [0, {limit}): {ids.tolist()}")
        # (a copy: a plan read from a Ray channel holds read-only arrays, which from_numpy
        # warns about)
        return torch.tensor(ids, dtype=torch.int64, device=device)

    def swap_out(self, pairs: np.ndarray) -> None:
        """Copy GPU blocks `pairs[:, 0]` to CPU blocks `pairs[:, 1]`, every layer, K and V."""
        if len(pairs) == 0:
            return
        src = self._ids(pairs, 0, self.num_gpu_blocks, "swap-out GPU", self.device)
        dst = self._ids(pairs, 1, self.num_cpu_blocks, "swap-out CPU", torch.device("cpu"))
        self.cpu_cache.index_copy_(2, dst, self.gpu_cache.index_select(2, src).cpu())

    def swap_in(self, pairs: np.ndarray) -> None:
        """Copy CPU blocks `pairs[:, 0]` to GPU blocks `pairs[:, 1]`, every layer, K and V."""
        if len(pairs) == 0:
            return
        src = self._ids(pairs, 0, self.num_cpu_blocks, "swap-in CPU", torch.device("cpu"))
        dst = self._ids(pairs, 1, self.num_gpu_blocks, "swap-in GPU", self.device)
        staged = self.cpu_cache.index_select(2, src)
        if self.device.type == "cuda":
            staged = staged.pin_memory()
        self.gpu_cache.index_copy_(2, dst, staged.to(self.device, non_blocking=True))

    def copy(self, pairs: np.ndarray) -> None:
        """Copy-on-write: GPU blocks `pairs[:, 0]` to GPU blocks `pairs[:, 1]` (all read first)."""
        if len(pairs) == 0:
            return
        src = self._ids(pairs, 0, self.num_gpu_blocks, "copy source", self.device)
        dst = self._ids(pairs, 1, self.num_gpu_blocks, "copy destination", self.device)
        self.gpu_cache.index_copy_(2, dst, self.gpu_cache.index_select(2, src))
