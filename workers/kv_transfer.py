"""The KV transfer's device side: pack a request's blocks of this rank into one payload,
unpack a payload into other block ids (prefill/decode disaggregation).

A payload is one contiguous tensor `[2 (K, V), num_layers, n, block_size, num_kv_heads,
head_dim]`, on the host (`to_host`, the object-store transport's) or on the cache's device (Ray
Direct Transport's, which sends it device to device): blocks `block_ids[i]` of every layer at index i, this rank's shard of
the KV heads. Its transport between replicas is the engine's (cluster/engine/kv_transport.py);
this module only copies between the cache tensor and the payload, with one gather or scatter
per contiguous run of block ids (a single run is one strided slice; scattered ids one
`index_select` / `index_copy_`), never a Python loop over blocks.

Invariants: `unpack_blocks(cache, ids2, pack_blocks(cache1, ids1))` leaves in blocks ids2 of
cache exactly what blocks ids1 of cache1 held (the same layout: `PayloadLayout` of both sides
equal, checked before any byte is written); blocks outside `block_ids` are never touched.
The caller orders the copy with the steps: no step in flight writes a block being packed or
reads or writes a block being unpacked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class PayloadLayout:
    """What a payload's shape and dtype must match on the receiving rank."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # of this rank (a TP shard)
    head_dim: int
    dtype: str

    @staticmethod
    def of(cache: torch.Tensor) -> PayloadLayout:
        """The layout of a cache tensor `[2, L, N, block_size, kv_heads, head_dim]`."""
        _, layers, _, block_size, heads, head_dim = cache.shape
        return PayloadLayout(layers, block_size, heads, head_dim, str(cache.dtype))


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """`(start, length)` of each maximal run of consecutive ids, in order."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [ids.size]))
    return [(int(ids[s]), int(e - s)) for s, e in zip(starts, ends)]


def _check_ids(cache: torch.Tensor, block_ids: Sequence[int]) -> None:
    n = cache.shape[2]
    bad = [b for b in block_ids if not 0 <= b < n]
    if bad:
        raise ValueError(f"KV transfer block ids {bad} are outside [0, {n})")


def pack_blocks(cache: torch.Tensor, block_ids: Sequence[int], to_host: bool = True
                ) -> torch.Tensor:
    """Blocks `block_ids` of every layer, K and V, as one contiguous tensor: on the host, or
    with `to_host` False a copy on the cache's device (never a view of the cache)."""
    _check_ids(cache, block_ids)
    runs = block_runs(block_ids)
    if len(runs) == 1:
        start, length = runs[0]
        packed = cache.narrow(2, start, length)
    else:
        index = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=cache.device)
        packed = cache.index_select(2, index)
    if to_host:
        return packed.to("cpu").contiguous()
    return packed.clone(memory_format=torch.contiguous_format)


def unpack_blocks(cache: torch.Tensor, block_ids: Sequence[int], payload: torch.Tensor) -> None:
    """Write a payload (pack_blocks' layout) into blocks `block_ids` of the cache."""
    _check_ids(cache, block_ids)
    want, got = PayloadLayout.of(cache), PayloadLayout.of(payload)
    if want != got:
        raise ValueError(f"KV payload layout {got} does not match this rank's cache {want}: "
                         "both sides must serve the same model with the same block_size, "
                         "kv_cache_dtype and tensor_parallel_size")
    if payload.shape[2] != len(block_ids):
        raise ValueError(f"KV payload holds {payload.shape[2]} blocks, {len(block_ids)} ids given")
    src = payload.to(cache.device, non_blocking=False)
    runs = block_runs(block_ids)
    if len(runs) == 1:
        start, length = runs[0]
        cache.narrow(2, start, length).copy_(src)
    else:
        index = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=cache.device)
        cache.index_copy_(2, index, src)
