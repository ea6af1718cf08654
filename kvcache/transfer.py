"""Blocks of a KV transfer between replicas (prefill/decode disaggregation): the prefill
side's hold on a finished prompt's cached blocks while they are copied out, and the decode
side's fresh blocks that receive them and then join its prefix cache.

Invariants:
  - a held block has a reference, so no allocation can take it (and its KV stays intact)
    until `release`; the hold is released exactly once, when the copy is out;
  - received blocks enter the prefix cache (`adopt`) only after their KV was written: a
    transfer that failed frees them unhashed, so no lookup ever hits a block without its KV;
  - after `release` / `adopt` / `abandon` every block's reference count is what it was
    before the transfer (the invariant checker finds no leak).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcache.block_pool import KVCacheBlock
from kvcache.hashing import BlockHash
from kvcache.manager import KVCacheManager


@dataclass(slots=True)
class BlockHold:
    """Blocks a transfer holds a reference on, in prefix order, and their block ids."""

    blocks: list[KVCacheBlock]

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


def _require_caching(kv: KVCacheManager) -> None:
    if not kv.enable_prefix_caching:
        raise ValueError("a KV transfer finds and registers blocks by their prefix hashes: "
                         "enable prefix caching on both the prefill and the decode engine")


def hold_cached_prefix(kv: KVCacheManager, block_hashes: Sequence[BlockHash]) -> BlockHold:
    """A reference on the cached blocks of the longest prefix of `block_hashes` that the
    device pool holds (a finished prompt's blocks are cached and free until reused)."""
    _require_caching(kv)
    pool = kv.gpu_pool
    blocks: list[KVCacheBlock] = []
    for h in block_hashes:
        block = pool.get_cached_block(h)
        if block is None:
            break
        blocks.append(block)
    pool.touch(blocks)
    return BlockHold(blocks)


def release(kv: KVCacheManager, hold: BlockHold) -> None:
    """Drop the hold's references, tail first (the prefix's head is evicted last)."""
    kv.gpu_pool.free_blocks(reversed(hold.blocks))
    hold.blocks = []


def reserve(kv: KVCacheManager, block_hashes: Sequence[BlockHash]) -> tuple[BlockHold, BlockHold]:
    """For receiving the KV of `block_hashes`: a hold on the leading blocks this pool already
    caches (nothing to receive for them) and fresh unhashed blocks for the rest. ValueError
    when the pool has too few free blocks."""
    cached = hold_cached_prefix(kv, block_hashes)
    missing = len(block_hashes) - len(cached.blocks)
    if missing > kv.gpu_pool.num_free_blocks:
        release(kv, cached)
        raise ValueError(f"{missing} free KV blocks needed to receive a transfer, "
                         f"{kv.gpu_pool.num_free_blocks} free")
    fresh = kv.gpu_pool.get_new_blocks(missing) if missing else []
    return cached, BlockHold(fresh)


def adopt(kv: KVCacheManager, cached: BlockHold, fresh: BlockHold,
          block_hashes: Sequence[BlockHash]) -> None:
    """The fresh blocks hold their KV now: cache them under the last hashes and free both
    holds, so the request's prefix lookup hits every block."""
    skip = len(cached.blocks)
    kv.gpu_pool.cache_blocks(fresh.blocks, list(block_hashes[skip:skip + len(fresh.blocks)]))
    release(kv, fresh)
    release(kv, cached)


def abandon(kv: KVCacheManager, cached: BlockHold, fresh: BlockHold) -> None:
    """The transfer failed: free both holds, the fresh blocks unhashed."""
    release(kv, fresh)
    release(kv, cached)
