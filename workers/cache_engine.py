"""The KV cache of one rank: a stacked device tensor, a CPU swap space and a CPU offload tier.

Device layout `[2 (K, V), num_layers, num_blocks, block_size, num_kv_heads, head_dim]`: block
`b` of every layer is `gpu_cache[:, :, b]`; each attention layer gets the views
`gpu_cache[0, i]` / `gpu_cache[1, i]` (what the kernels take). The swap space is block-major,
`[num_cpu_blocks, 2, num_layers, block_size, num_kv_heads, head_dim]`, so a CPU block is one
contiguous (pinned, on CUDA) region and a swap is one asynchronous copy per block pair. The
offload tier (`kv_offloading_size`, kvcache/offload.py) has the swap space's layout, its own
ids and its own memory: `offload` copies evicted prefix blocks out, `load` copies them back.

Invariant (CUDA): swaps, offloads, loads and copy-on-write never wait on the host and never
copy from pageable memory. A step's host<->GPU copies (`transfer`: offload, swap-out, swap-in,
load, in the plan's order) run on the side copy stream of workers/copy_stream.py, after
everything already enqueued on the compute stream; `wait_transfers` makes the compute stream
wait for them before the forward (and `copy` does before copy-on-write, whose source may be a
block just swapped in). Block ids are python ints (no index tensor goes up to the device);
the host never reads or writes the swap space or the tier, so nothing waits for a copy to
land. Swaps and forks are rare (preemption, n > 1), so one small copy per block pair costs
less than staging an index tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from workers.copy_stream import CopyStream
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
        self.copy_stream = CopyStream(device)
        # One block in the device's contiguous layout: a GPU block is strided (`gpu_cache[:, :,
        # b]`), and a strided copy across devices would allocate a contiguous temporary per
        # copy; through this buffer each pair is a strided on-device copy plus one contiguous
        # host<->device copy, both on the copy stream, so reusing it keeps their order.
        self._staging = torch.empty(cpu_shape[1:] if num_cpu_blocks + num_offload_blocks else 0,
                                    dtype=dtype, device=device)
        self.copy_stream.share(self.gpu_cache, self._staging)
        self._host = {"offload": (self.offload_cache, num_offload_blocks, "tier"),
                      "swap": (self.cpu_cache, num_cpu_blocks, "CPU")}

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
        self.transfer(swap_out=pairs)

    def swap_in(self, pairs: np.ndarray) -> None:
        """Copy CPU blocks `pairs[:, 0]` to GPU blocks `pairs[:, 1]`, every layer, K and V."""
        self.transfer(swap_in=pairs)

    def offload(self, pairs: np.ndarray) -> None:
        """Copy GPU blocks `pairs[:, 0]` to offload-tier blocks `pairs[:, 1]`, in order (a
        later pair may overwrite a tier block an earlier one wrote)."""
        self.transfer(offload=pairs)

    def load(self, pairs: np.ndarray) -> None:
        """Copy offload-tier blocks `pairs[:, 0]` to GPU blocks `pairs[:, 1]`."""
        self.transfer(load=pairs)

    def transfer(self, offload: np.ndarray | None = None, swap_out: np.ndarray | None = None,
                 swap_in: np.ndarray | None = None, load: np.ndarray | None = None) -> None:
        """One step's host<->GPU copies in this order (scheduler/plan.py), one non-blocking copy
        per block pair on the copy stream; every id is checked before any copy is enqueued.
        The compute stream does not see them until `wait_transfers`."""
        out, back = [], []  # ([(gpu, host id)], host buffer), ([(host id, gpu)], host buffer)
        for what, pairs, tier in (("offload", offload, "offload"), ("swap-out", swap_out, "swap")):
            if pairs is not None and len(pairs):
                buf, n, name = self._host[tier]
                out.append((self._pairs(pairs, (self.num_gpu_blocks, n),
                                        (f"{what} GPU", f"{what} {name}")), buf))
        for what, pairs, tier in (("swap-in", swap_in, "swap"), ("load", load, "offload")):
            if pairs is not None and len(pairs):
                buf, n, name = self._host[tier]
                back.append((self._pairs(pairs, (n, self.num_gpu_blocks),
                                         (f"{what} {name}", f"{what} GPU")), buf))
        if not out and not back:
            return
        self.copy_stream.begin()
        try:
            staging = self._staging
            for checked, buf in out:
                for gpu, dst in checked:
                    staging.copy_(self.gpu_cache[:, :, gpu])
                    buf[dst].copy_(staging, non_blocking=True)
            for checked, buf in back:
                for src, gpu in checked:
                    staging.copy_(buf[src], non_blocking=True)
                    self.gpu_cache[:, :, gpu].copy_(staging)
        finally:
            self.copy_stream.end()

    def wait_transfers(self) -> None:
        """The compute stream waits (on the device) for every `transfer` enqueued so far."""
        self.copy_stream.wait()

    def copy(self, pairs: np.ndarray) -> None:
        """Copy-on-write: GPU blocks `pairs[:, 0]` to GPU blocks `pairs[:, 1]` (all read first:
        a block may be one pair's destination and a later pair's source)."""
        if len(pairs) == 0:
            return
        self.wait_transfers()
        checked = self._pairs(pairs, (self.num_gpu_blocks, self.num_gpu_blocks),
                              ("copy source", "copy destination"))
        sources = torch.stack([self.gpu_cache[:, :, src] for src, _ in checked], dim=2)
        for i, (_, dst) in enumerate(checked):
            self.gpu_cache[:, :, dst].copy_(sources[:, :, i])
