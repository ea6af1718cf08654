"""The KV cache of one rank: a stacked device tensor, a CPU swap space and a CPU offload tier.

Device layout `[2 (K, V), num_layers, num_blocks, block_size, num_kv_heads, head_dim]`: block
`b` of every layer is `gpu_cache[:, :, b]`; each attention layer gets the views
`gpu_cache[0, i]` / `gpu_cache[1, i]` (what the kernels take). The swap space is block-major,
`[num_cpu_blocks, 2, num_layers, block_size, num_kv_heads, head_dim]`, so a CPU block is one
contiguous (pinned, on CUDA) region and a swap is one asynchronous copy per block pair. The
offload tier (`kv_offloading_size`, kvcache/offload.py) has the swap space's layout, its own
ids and its own memory: `offload` copies evicted prefix blocks out, `load` copies them back.

Invariant (CUDA): swaps, offloads, loads and copy-on-write never wait on the host and never
copy from pageable memory. Every copy is enqueued on the current stream with python-int block ids (no index
tensor goes up to the device), so it is ordered after the step that wrote the source blocks
and before the step that reads the destinations; the host never reads or writes the swap
space, so nothing has to wait for a swap to land. Swaps and forks are rare (preemption,
n > 1), so one small copy per block pair costs less than staging an index tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from workers.layers.attention import Attention


class CacheEngine:
    """Owns the device KV blocks and the CPU swap blocks; ids are the scheduler's block ids."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_gpu_blocks: int, num_cpu_blocks: int, dtype: torch.dtype,
                 device: torch.device, num_offload_blocks: int = 0) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1; got {num_gpu_blocks}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0; got {num_cpu_blocks}")
        if num_offload_blocks < 0:
            raise ValueError(f"num_offload_blocks must be >= 0; got {num_offload_blocks}")
        self.device = device
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        shape = (2, num_layers, num_gpu_blocks, block_size, num_kv_heads, head_dim)
        # CUDA: zeros, so the padded rows of a CUDA-graph batch only ever read finite values.
        # CPU: empty, so untouched blocks cost no memory (every read block was written first).
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        self.gpu_cache = alloc(shape, dtype=dtype, device=device)
        cpu_shape = (num_cpu_blocks, 2, num_layers, block_size, num_kv_heads, head_dim)
        self.cpu_cache = torch.empty(cpu_shape, dtype=dtype, device="cpu",
                                     pin_memory=device.type == "cuda" and num_cpu_blocks > 0)
        self.num_offload_blocks = num_offload_blocks
        self.offload_cache = torch.empty((num_offload_blocks, *cpu_shape[1:]), dtype=dtype,
                                         device="cpu",
                                         pin_memory=device.type == "cuda" and num_offload_blocks > 0)

    def bind(self, layers: list[Attention]) -> None:
        """Point every attention layer at its slice of the stacked cache."""
        if len(layers) != self.gpu_cache.shape[1]:
            raise ValueError(f"cache has {self.gpu_cache.shape[1]} layers, model {len(layers)}")
        for i, attn in enumerate(layers):
            attn.k_cache = self.gpu_cache[0, i]
            attn.v_cache = self.gpu_cache[1, i]

    @staticmethod
    def _pairs(pairs: np.ndarray, limits: tuple[int, int], what: tuple[str, str]
               ) -> list[tuple[int, int]]:
        """The pairs as python ints, each column checked against its pool's size."""
        for col in (0, 1):
            ids = pairs[:, col]
            if ids.min() < 0 or ids.max() >= limits[col]:
                raise ValueError(f"{what[col]} block id out of range [0, {limits[col]}): "
                                 f"{ids.tolist()}")
        return [(int(a), int(b)) for a, b in pairs]

    def swap_out(self, pairs: np.ndarray) -> None:
        """Copy GPU blocks `pairs[:, 0]` to CPU blocks `pairs[:, 1]`, every layer, K and V."""
        self._to_host(pairs, self.cpu_cache, self.num_cpu_blocks, "swap-out")

    def swap_in(self, pairs: np.ndarray) -> None:
        """Copy CPU blocks `pairs[:, 0]` to GPU blocks `pairs[:, 1]`, every layer, K and V."""
        self._from_host(pairs, self.cpu_cache, self.num_cpu_blocks, "swap-in")

    def offload(self, pairs: np.ndarray) -> None:
        """Copy GPU blocks `pairs[:, 0]` to offload-tier blocks `pairs[:, 1]`, in order (a
        later pair may overwrite a tier block an earlier one wrote)."""
        self._to_host(pairs, self.offload_cache, self.num_offload_blocks, "offload", "tier")

    def load(self, pairs: np.ndarray) -> None:
        """Copy offload-tier blocks `pairs[:, 0]` to GPU blocks `pairs[:, 1]`."""
        self._from_host(pairs, self.offload_cache, self.num_offload_blocks, "load", "tier")

    def _to_host(self, pairs: np.ndarray, host: torch.Tensor, num_host: int, what: str,
                 host_name: str = "CPU") -> None:
        """(GPU, host) pairs in order, one non-blocking copy each (swap-out and offload)."""
        if len(pairs) == 0:
            return
        for gpu, dst in self._pairs(pairs, (self.num_gpu_blocks, num_host),
                                    (f"{what} GPU", f"{what} {host_name}")):
            host[dst].copy_(self.gpu_cache[:, :, gpu], non_blocking=True)

    def _from_host(self, pairs: np.ndarray, host: torch.Tensor, num_host: int, what: str,
                   host_name: str = "CPU") -> None:
        """(host, GPU) pairs in order, one non-blocking copy each (swap-in and load)."""
        if len(pairs) == 0:
            return
        for src, gpu in self._pairs(pairs, (num_host, self.num_gpu_blocks),
                                    (f"{what} {host_name}", f"{what} GPU")):
            self.gpu_cache[:, :, gpu].copy_(host[src], non_blocking=True)

    def copy(self, pairs: np.ndarray) -> None:
        """Copy-on-write: GPU blocks `pairs[:, 0]` to GPU blocks `pairs[:, 1]` (all read first:
        a block may be one pair's destination and a later pair's source)."""
        if len(pairs) == 0:
            return
        checked = self._pairs(pairs, (self.num_gpu_blocks, self.num_gpu_blocks),
                              ("copy source", "copy destination"))
        sources = torch.stack([self.gpu_cache[:, :, src] for src, _ in checked], dim=2)
        for i, (_, dst) in enumerate(checked):
            self.gpu_cache[:, :, dst].copy_(sources[:, :, i])
