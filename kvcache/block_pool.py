"""Blocks, the LRU free queue and the block pool of one device (GPU or CPU).

Mechanism only: the pool knows blocks, ref counts, hashes and the free queue; the
KVCacheManager decides what a sequence needs.

There is no null/padding block: block tables are padded and masked by sequence length
in the kernels, so every block id in [0, num_blocks) holds real data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, repeat

from kvcache.events import DEVICE, KVEventLog
from kvcache.hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical block.

    Invariants: ref_cnt == number of block tables holding this block; ref_cnt == 0 iff the
    block is in its pool's free queue; block_hash is set only on a full block whose KV
    matches that hash, and then the pool's cache map holds it under that hash.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks between two sentinels.

    O(1) popleft, append, appendleft and remove-from-middle (a prefix hit revives a free
    block). The head is the next block to be reused. The pool keeps clean blocks (no hash)
    before cached ones, and cached ones in LRU order, so popleft takes a clean block while
    one is left and otherwise evicts the least recently freed cached block.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        prev = self.head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.tail
        self.tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free_block
        if block is self.tail:
            raise ValueError("no free block left in the queue")
        nxt = block.next_free_block
        self.head.next_free_block = nxt
        nxt.prev_free_block = self.head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} are free")
        out = []
        block = self.head.next_free_block
        for _ in range(n):
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self.head.next_free_block = block
        block.prev_free_block = self.head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self.head.next_free_block
        first.prev_free_block = block
        block.next_free_block = first
        block.prev_free_block = self.head
        self.head.next_free_block = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.head.next_free_block
        while block is not self.tail:
            yield block
            block = block.next_free_block

    def block_ids(self) -> list[int]:
        """Free block ids from head (next reused) to tail."""
        return [b.block_id for b in self]


class BlockPool:
    """All blocks of one device, their ref counts, the free queue and the prefix-cache map.

    Free blocks are either clean (no hash) or cached (hash set, KV still valid and findable
    through the cache map). Freed clean blocks go to the head of the free queue, freed cached
    blocks to the tail, so allocation uses clean blocks first and evicts the least recently
    freed cached block only when no clean block is left. An evicted block's hash leaves the
    cache map. The map tolerates several blocks with one hash (two sequences that filled
    identical blocks independently).

    With `events` (kvcache/events.py), each hash entering the map and each leaving it is
    reported, in order, tagged with `medium`.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 events: KVEventLog | None = None, medium: str = DEVICE) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self.num_evictions = 0
        # Called as on_evict(block_id, block_hash) for each hashed block about to be reused,
        # while its KV is still there (the CPU offload tier copies it out: kvcache/offload.py).
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        self.events = events
        self.medium = medium

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks referenced by some table (cached free blocks count as free)."""
        if self.num_blocks == 0:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def get_new_block(self) -> KVCacheBlock:
        """get_new_blocks(1)[0] without the batch machinery (a decode step's new block)."""
        queue = self.free_block_queue
        head = queue.head
        block = head.next_free_block
        if block is queue.tail:
            raise ValueError("asked for 1 free block, only 0 are free")
        nxt = block.next_free_block
        head.next_free_block = nxt
        nxt.prev_free_block = head
        block.prev_free_block = block.next_free_block = None
        queue.num_free_blocks -= 1
        if block.block_hash is not None:
            self._evict(block)
        block.ref_cnt = 1
        return block

    def get_new_blocks(
        self, num_blocks: int, block_hashes: Sequence[BlockHash] = ()
    ) -> list[KVCacheBlock]:
        """Take num_blocks from the head of the free queue with ref_cnt = 1, evicting hashes.

        The first len(block_hashes) of them are then cached under those hashes (cache_blocks),
        in the same walk of the queue: this is the whole cost of allocating a long prompt.
        """
        if len(block_hashes) > num_blocks:
            raise ValueError(f"{len(block_hashes)} hashes for {num_blocks} new blocks")
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} free blocks, only {queue.num_free_blocks} are free")
        head = queue.head
        blocks: list[KVCacheBlock] = []
        append = blocks.append
        block = head.next_free_block
        num_hashed = len(block_hashes)
        # Hashes are set in the walk, after each block's old hash is evicted; the map takes the
        # new ones only after the walk, so no eviction can remove a new entry.
        for h in chain(block_hashes, repeat(None, num_blocks - num_hashed)):
            append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            block.block_hash = h
            block = nxt
        head.next_free_block = block
        block.prev_free_block = head
        queue.num_free_blocks -= num_blocks
        if num_hashed:
            self._register(blocks, block_hashes)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        key = block.block_hash
        if self.on_evict is not None:
            self.on_evict(block.block_id, key)
        entry = self.cached_block_hash_to_block[key]
        if isinstance(entry, KVCacheBlock):
            del self.cached_block_hash_to_block[key]
            if self.events is not None:
                self.events.evicted(self.medium, key)
        else:
            del entry[block.block_id]
            if len(entry) == 1:
                self.cached_block_hash_to_block[key] = next(iter(entry.values()))
        block.block_hash = None
        self.num_evictions += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching 0 join the free queue in order.

        Pass a sequence's blocks tail-first: the first freed cached block is the first evicted.
        """
        queue = self.free_block_queue
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block, reviving free (cached) ones out of the free queue."""
        queue = self.free_block_queue
        revived = 0
        for block in blocks:
            if block.ref_cnt:
                block.ref_cnt += 1
                continue
            prev = block.prev_free_block
            nxt = block.next_free_block
            if prev is None or nxt is None:
                queue.num_free_blocks -= revived
                raise ValueError(f"block {block.block_id} is not in the free queue")
            prev.next_free_block = nxt
            nxt.prev_free_block = prev
            block.prev_free_block = block.next_free_block = None
            block.ref_cnt = 1
            revived += 1
        queue.num_free_blocks -= revived

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Record that a full, referenced block holds the KV named by block_hash."""
        block.block_hash = block_hash
        cache = self.cached_block_hash_to_block
        entry = cache.get(block_hash)
        if entry is None:
            cache[block_hash] = block
            if self.events is not None:
                self.events.stored(self.medium, (block_hash,))
        elif isinstance(entry, KVCacheBlock):
            cache[block_hash] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def cache_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]) -> None:
        """cache_block for each (block, hash) pair, in order (equal lengths)."""
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
        for block, h in zip(blocks, block_hashes):
            block.block_hash = h
        self._register(blocks, block_hashes)

    def _register(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]) -> None:
        """Enter blocks[i] (block_hash already set) into the map under block_hashes[i]."""
        cache = self.cached_block_hash_to_block
        n = len(block_hashes)
        if n > 1:
            # Built apart, then merged: the merge presizes the map once (and copies the table
            # outright into an empty map) instead of growing it entry by entry.
            batch = dict(zip(block_hashes, blocks))
            if len(batch) == n and cache.keys().isdisjoint(batch):
                cache.update(batch)
                if self.events is not None:
                    self.events.stored(self.medium, block_hashes)
                return
            # a hash already in the map or repeated in the batch: build the shared entries
        for block, h in zip(blocks, block_hashes):
            self.cache_block(block, h)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """Any block holding block_hash, or None."""
        entry = self.cached_block_hash_to_block.get(block_hash)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant of this pool."""
        seen: set[int] = set()
        prev = self.free_block_queue.head
        seen_cached = False
        for block in self.free_block_queue:
            if block.prev_free_block is not prev:
                raise AssertionError(f"free queue link broken before block {block.block_id}")
            if block.block_id in seen:
                raise AssertionError(f"block {block.block_id} twice in the free queue")
            seen.add(block.block_id)
            if block.ref_cnt != 0:
                raise AssertionError(f"block {block.block_id} is free with ref_cnt {block.ref_cnt}")
            if block.block_hash is None and seen_cached:
                raise AssertionError(f"clean block {block.block_id} queued behind a cached block")
            seen_cached = seen_cached or block.block_hash is not None
            prev = block
        if self.free_block_queue.tail.prev_free_block is not prev:
            raise AssertionError("free queue tail sentinel is not linked to the last free block")
        if len(seen) != self.free_block_queue.num_free_blocks:
            raise AssertionError(
                f"free queue holds {len(seen)} blocks, num_free_blocks says "
                f"{self.free_block_queue.num_free_blocks}"
            )
        for block in self.blocks:
            if block.block_id not in seen:
                if block.ref_cnt <= 0:
                    raise AssertionError(f"block {block.block_id} is neither free nor referenced")
                if block.prev_free_block is not None or block.next_free_block is not None:
                    raise AssertionError(f"referenced block {block.block_id} has free-queue links")
            if block.block_hash is not None:
                if not self.enable_caching:
                    raise AssertionError(f"block {block.block_id} hashed in a pool without caching")
                entry = self.cached_block_hash_to_block.get(block.block_hash)
                members = {entry.block_id: entry} if isinstance(entry, KVCacheBlock) else entry
                if not members or members.get(block.block_id) is not block:
                    raise AssertionError(f"hashed block {block.block_id} missing from the cache map")
        for key, entry in self.cached_block_hash_to_block.items():
            members = [entry] if isinstance(entry, KVCacheBlock) else list(entry.values())
            if isinstance(entry, dict) and len(entry) < 2:
                raise AssertionError(f"cache map entry {key.hex()} is a dict of {len(entry)}")
            for block in members:
                if block.block_hash != key or self.blocks[block.block_id] is not block:
                    raise AssertionError(f"cache map points at block {block.block_id} under a foreign hash")
