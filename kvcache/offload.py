"""The CPU tier of prefix blocks: where the GPU pool's evicted, hashed blocks go instead of
being forgotten, and where a prefix lookup that misses on the GPU looks next.

The tier is its own BlockPool of CPU block ids in [0, num_blocks) (apart from the swap pool:
its budget is `kv_offloading_size`, swap's is `swap_space`, so swap-out for preemption never
competes with it for a block). Every tier block that is not being loaded in the step under
construction is free: clean (never written) or holding its hash, so the pool's free queue is
the tier's LRU: a block offloaded or loaded goes to the tail, and the head (clean blocks
first) is the next one overwritten.

Per step (one `schedule()` call), the manager gathers:
  - offloads (GPU block, tier block): the GPU pool calls `offload` for every hashed block it
    evicts (BlockPool.on_evict), before the block is reused. A hash the tier already holds is
    not copied again (blocks are written once); it only moves to the LRU tail.
  - loads (tier block, GPU block): `pin` + `add_loads` for a prefix hit in the tier. A pinned
    block is referenced, so no offload of the same step can overwrite it.
`take_transfers` hands both lists to the plan and unpins. Workers apply every offload before
anything of the step writes a GPU block, and every load after all offloads and before the
forward pass (scheduler/plan.py; on CUDA all of them on one side copy stream, fenced after the
compute before the step and waited on by the step's forward: workers/copy_stream.py), so: an
offload reads the evicted block's KV before its new owner writes it; a load may read a tier
block written by an offload of the same step.

Invariants (`check_invariants`): the tier pool's own; a hash is held by at most one tier
block (write once); a block is referenced only while pinned by this step's loads.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.block_pool import BlockPool, KVCacheBlock
from kvcache.events import CPU, KVEventLog
from kvcache.hashing import BlockHash
from kvcache.prefix import PrefixCache


class OffloadTier:
    """Which hash is in which CPU block, the LRU, the budget, and this step's copies."""

    def __init__(self, num_blocks: int, events: KVEventLog | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_offload_blocks must be >= 0 (0: no tier), got {num_blocks}")
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks, True, events, CPU)  # events: what a router follows
        self.offloads: list[tuple[int, int]] = []  # (gpu, tier) this step
        self.loads: list[tuple[int, int]] = []  # (tier, gpu) this step
        self._pinned: list[KVCacheBlock] = []
        self.num_offloaded = 0  # blocks copied GPU -> tier (cumulative)
        self.num_loaded = 0  # blocks copied tier -> GPU (cumulative)
        self.queries = 0  # prompt tokens looked up here after a GPU miss (cumulative)
        self.hits = 0  # of those, tokens loaded from here (cumulative)

    def usage(self) -> float:
        """Fraction of tier blocks holding a hash."""
        return len(self.pool.cached_block_hash_to_block) / self.num_blocks

    def offload(self, gpu_block_id: int, block_hash: BlockHash) -> None:
        """The GPU pool is about to reuse gpu_block_id, which holds block_hash's KV."""
        pool = self.pool
        held = pool.cached_block_hash_to_block.get(block_hash)
        if held is not None:  # written once: refresh its place in the LRU only
            if held.ref_cnt == 0:
                pool.free_block_queue.remove(held)
                pool.free_block_queue.append(held)
            return
        if not pool.free_block_queue.num_free_blocks:
            return  # every tier block is pinned by this step's loads: this one is dropped
        block = pool.get_new_block()  # the LRU tail's opposite end: the oldest hash goes
        pool.cache_block(block, block_hash)
        pool.free_blocks((block,))
        self.offloads.append((gpu_block_id, block.block_id))
        self.num_offloaded += 1

    def lookup(self, prefix: PrefixCache, token_ids: Sequence[int], start: int,
               extra_key: bytes | None, block_hashes: Sequence[BlockHash] | None) -> list[int]:
        """Tier block ids of token_ids' full blocks from block `start` (after a GPU hit of that
        many) up to the first one not held here, never the block of the last token (as
        PrefixCache.lookup); block_hashes as there, hashed here where too few."""
        stop = (len(token_ids) - 1) // prefix.block_size
        if stop <= start:
            return []
        if block_hashes is None or len(block_hashes) < stop:
            block_hashes = prefix.full_block_hashes(token_ids, stop, extra_key, block_hashes or ())
        cache = self.pool.cached_block_hash_to_block
        ids = []
        for h in block_hashes[start:stop]:
            block = cache.get(h)
            if block is None:
                break
            ids.append(block.block_id)
        return ids

    def check(self, tier_block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """The blocks, after checking that each still holds its position's hash."""
        blocks = self.pool.blocks
        out = []
        for bid, h in zip(tier_block_ids, hashes, strict=True):
            if not 0 <= bid < self.num_blocks or blocks[bid].block_hash != h:
                raise ValueError(f"offloaded block {bid} no longer holds this prompt's KV; call "
                                 "lookup_offloaded right before allocate_new")
            out.append(blocks[bid])
        return out

    def pin(self, blocks: list[KVCacheBlock]) -> None:
        """Keep blocks from being overwritten until take_transfers (they are loaded this step)."""
        self.pool.touch(blocks)
        self._pinned += blocks

    def add_loads(self, blocks: Sequence[KVCacheBlock], gpu_block_ids: Sequence[int]) -> None:
        self.loads += zip((b.block_id for b in blocks), gpu_block_ids)
        self.num_loaded += len(blocks)

    def count(self, queried: int, hit: int) -> None:
        """Prompt tokens looked up here after a GPU miss, and of those, loaded from here."""
        self.queries += queried
        self.hits += hit

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (offloads, loads), in order; unpins the loaded blocks (to the LRU tail)."""
        out = self.offloads, self.loads
        self.offloads, self.loads = [], []
        if self._pinned:
            self.pool.free_blocks(self._pinned)
            self._pinned = []
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant of the tier."""
        self.pool.check_invariants()
        for entry in self.pool.cached_block_hash_to_block.values():
            if not isinstance(entry, KVCacheBlock):
                raise AssertionError(f"a hash is held by {len(entry)} tier blocks (written twice)")
        pinned = {b.block_id for b in self._pinned}
        for block in self.pool.blocks:
            if block.ref_cnt and block.block_id not in pinned:
                raise AssertionError(f"tier block {block.block_id} referenced but not pinned")
