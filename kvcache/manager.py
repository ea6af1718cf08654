"""KVCacheManager: per-sequence block tables over a GPU pool (with prefix caching) and a CPU
swap pool, with fork + copy-on-write for parallel sampling and group swap out/in.

Per-sequence state (invariants, checked by `check_invariants`):
  - len(block_ids) == ceil(num_slots / block_size); token i's KV lives in
    block_ids[i // block_size] at offset i % block_size;
  - with prefix caching, block_hashes[i] is the chained hash of full block i and
    len(block_hashes) == num_slots // block_size; on the GPU every full block carries it.
    One exception: a slot reserved ahead of its token (`num_pending`, async scheduling) that
    fills a block leaves that block unhashed until its token is known; the next block the
    sequence opens hashes it first, so at most the last full block lags;
  - a swapped-out sequence's block_ids are CPU block ids.
Per-step cost is O(new tokens): decode touches at most one new block and hashes at most one
full block, never the whole context.

A block is entered into the prefix cache when its slots are allocated, before the forward
pass writes its KV. That is safe because a sequence hitting it is in the same or a later
step, and every layer writes the whole batch's KV before attending.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from kvcache.block_pool import BlockPool, KVCacheBlock
from kvcache.hashing import (
    BlockHash,
    block_hasher,
    hash_packed_blocks,
    pack_token_ids,
    prompt_block_hashes,
)
from kvcache.invariants import check_manager_invariants
from kvcache.swap import SwapMixin
from kvcache.tables import NOTHING_NEW as _NOTHING_NEW
from kvcache.tables import Allocation, SeqBlocks

_block_id = attrgetter("block_id")
_block_hash = attrgetter("block_hash")
_ref_cnt = attrgetter("ref_cnt")


@dataclass(slots=True)
class KVCacheStats:
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    gpu_usage: float  # fraction of GPU blocks referenced by some sequence
    cpu_usage: float
    prefix_queries: int  # tokens queried (cumulative)
    prefix_hits: int  # tokens hit (cumulative)
    evictions: int  # cached blocks evicted (cumulative)


@dataclass(slots=True)
class _LastHit:
    """What the last lookup_prefix given a request's hashes found (see _prefix_blocks)."""

    block_hashes: Sequence[BlockHash]
    evictions: int  # the GPU pool's eviction count then
    ids: list[int]
    blocks: list[KVCacheBlock]


class KVCacheManager(SwapMixin):
    """Block tables of all sequences; the scheduler's only view of KV memory.

    Ids returned are physical block ids in [0, num_gpu_blocks) (GPU) or [0, num_cpu_blocks)
    (CPU); they are what the workers index with. There is no padding block id: tables are
    padded and masked by length in the kernels.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
    ) -> None:
        if num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be > 0, got {num_gpu_blocks}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark is a fraction of GPU blocks in [0, 1), got {watermark}")
        self.block_size = block_size
        self._hash_block = block_hasher(block_size)
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark
        self.watermark_blocks = math.ceil(watermark * num_gpu_blocks)
        self.gpu_pool = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False)
        self._seqs: dict[int, SeqBlocks] = {}
        self._last_hit: _LastHit | None = None
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_gpu_blocks(self) -> int:
        """Free GPU blocks, cached ones included (they are evictable)."""
        return self.gpu_pool.free_block_queue.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.free_block_queue.num_free_blocks

    # ---- prefix caching -------------------------------------------------------------------

    def lookup_prefix(
        self,
        token_ids: Sequence[int],
        extra_key: bytes | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
    ) -> list[int]:
        """GPU block ids of the longest cached full-block prefix of token_ids.

        Never covers the last token (at most (len(token_ids) - 1) // block_size blocks), so a
        request always has at least one token to compute. No side effects on blocks or stats.
        block_hashes, if given, must be prompt_block_hashes(token_ids[:k * block_size],
        block_size, extra_key) for some k (a request hashes its prompt once, on arrival); the
        lookup then hashes nothing and stops after k blocks. Without them the tokens are hashed
        here (and again by allocate_slots).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_hit = (len(token_ids) - 1) // bs
        if max_hit <= 0:
            return []
        cache = self.gpu_pool.cached_block_hash_to_block
        given = block_hashes is not None
        if block_hashes is None:
            if self._hash_block(None, token_ids[:bs], extra_key) not in cache:
                return []  # a miss at block 0 (a cold prompt): hash nothing more
            block_hashes = prompt_block_hashes(token_ids[: max_hit * bs], bs, extra_key)
        if not block_hashes or block_hashes[0] not in cache:
            return []  # a cold prompt: no map pass over its hashes
        entries = list(map(cache.get, block_hashes[:max_hit]))
        try:
            ids = list(map(_block_id, entries))  # a full hit, one block per hash: C loops only
        except AttributeError:  # a miss (None) ends the hit; a shared entry names several blocks
            if None in entries:
                del entries[entries.index(None):]
            entries = [e if type(e) is KVCacheBlock else next(iter(e.values())) for e in entries]
            ids = list(map(_block_id, entries))
        if given:
            # allocate_slots with these very hashes and ids takes the blocks from here unchecked
            # while no block has been evicted since (then every one still holds its hash)
            self._last_hit = _LastHit(block_hashes, self.gpu_pool.num_evictions, ids, entries)
        return list(ids)

    def _full_block_hashes(
        self, token_ids: Sequence[int], num_full: int, extra_key: bytes | None,
        known: Sequence[BlockHash],
    ) -> list[BlockHash]:
        """Chained hashes of the first num_full blocks, the known ones taken as given."""
        hashes = list(known[:num_full])
        if len(hashes) < num_full:
            bs = self.block_size
            start = len(hashes)
            hash_packed_blocks(pack_token_ids(token_ids[start * bs : num_full * bs]), bs, 0,
                               num_full - start, hashes[-1] if hashes else None, extra_key, hashes)
        return hashes

    # ---- allocation -----------------------------------------------------------------------

    def num_blocks_needed(
        self, seq_id: int, num_new_tokens: int, prefix_block_ids: Sequence[int] = ()
    ) -> int:
        """Free GPU blocks allocate_slots(seq_id, ..., num_new_tokens, prefix_block_ids) takes:
        new blocks + copy-on-write blocks + prefix blocks that sit in the free queue."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        bs = self.block_size
        seq = self._seqs.get(seq_id)
        if seq is None:
            blocks = self.gpu_pool.blocks
            revive = sum(1 for b in prefix_block_ids if blocks[b].ref_cnt == 0)
            num_slots = len(prefix_block_ids) * bs + num_new_tokens
            return -(-num_slots // bs) - len(prefix_block_ids) + revive
        if seq.swapped:
            raise ValueError(f"seq {seq_id} is swapped out; swap_in before allocating slots")
        if prefix_block_ids:
            raise ValueError(f"seq {seq_id} already has blocks; prefix_block_ids is only for a new seq")
        num_slots = seq.num_slots
        needed = -(-(num_slots + num_new_tokens) // bs) - len(seq.block_ids)
        if num_new_tokens and num_slots % bs and self.gpu_pool.blocks[seq.block_ids[-1]].ref_cnt > 1:
            needed += 1
        return needed

    def allocate_slots(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        prefix_block_ids: Sequence[int] = (),
        extra_key: bytes | None = None,
        admit: bool = False,
        block_hashes: Sequence[BlockHash] = (),
        num_pending: int = 0,
    ) -> Allocation | None:
        """Reserve KV slots for the seq's next num_new_tokens tokens.

        token_ids is the seq's whole known token list, followed by num_pending tokens still
        being sampled (async scheduling computes a token in the step after the one that
        samples it, before the scheduler knows it): blocks those fill are hashed later.
        Afterwards the seq has slots for token_ids[:num_slots(seq_id)] (and the pending
        tokens): num_slots grows by num_new_tokens, plus, on the first
        call, len(prefix_block_ids) * block_size tokens covered by the prefix blocks (which must
        come from lookup_prefix of the same tokens and extra_key, with no allocation between).
        On the first call, block_hashes (as for lookup_prefix: the chained hashes of some
        leading full blocks, usually the prompt's) spare hashing those blocks, now and when
        later chunks fill them. Returns None and changes nothing when too few GPU blocks are
        free; with admit=True it also refuses when fewer than the watermark would remain free.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            return self._allocate_new(seq_id, token_ids, num_new_tokens, prefix_block_ids, extra_key,
                                      admit, block_hashes)
        if seq.swapped:
            raise ValueError(f"seq {seq_id} is swapped out; swap_in before allocating slots")
        if prefix_block_ids:
            raise ValueError(f"seq {seq_id} already has blocks; prefix_block_ids is only for a new seq")
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        num_slots = seq.num_slots
        total = num_slots + num_new_tokens
        if total > len(token_ids) + num_pending:
            raise ValueError(
                f"seq {seq_id}: {num_slots} slots + {num_new_tokens} new tokens exceeds the "
                f"{len(token_ids)} known token ids + {num_pending} pending; pass the seq's "
                "whole token list"
            )
        # The common decode step: the tokens fit in the last block, which this seq owns alone.
        # Decided from small ints on the seq alone: touching the table or the block (cache
        # misses) or computing on token counts > 256 (heap ints) would grow with the context.
        room = seq.tail_room
        if num_new_tokens <= room and (
            num_new_tokens == 0
            or not seq.shared_tail
            or self.gpu_pool.blocks[seq.block_ids[-1]].ref_cnt == 1
        ):
            seq.num_slots = total
            seq.tail_room = room = room - num_new_tokens
            if room == 0 and num_new_tokens and self.enable_prefix_caching:
                self._cache_full_blocks(seq, token_ids)  # the last block just became full
            return _NOTHING_NEW
        bs = self.block_size
        table = seq.block_ids
        pool = self.gpu_pool
        # from tail_room (small ints): ceil(total / bs) - len(table) and num_slots % bs != 0
        num_new_blocks = -((room - num_new_tokens) // bs)
        cow = num_new_tokens > 0 and room > 0 and seq.shared_tail and pool.blocks[table[-1]].ref_cnt > 1
        needed = num_new_blocks + cow
        free = pool.free_block_queue.num_free_blocks
        if needed > free or (admit and free - needed < self.watermark_blocks):
            return None
        copies: list[tuple[int, int]] = []
        if cow:
            src = pool.blocks[table[-1]]
            dst = pool.get_new_block()
            src.ref_cnt -= 1  # stays >= 1: another table still holds it
            table[-1] = dst.block_id
            copies.append((src.block_id, dst.block_id))
        if num_new_blocks == 1:
            new_ids = [pool.get_new_block().block_id]
            table.append(new_ids[0])
        elif num_new_blocks > 1:
            new_ids = list(map(_block_id, pool.get_new_blocks(num_new_blocks)))
            table.extend(new_ids)
        else:
            new_ids = []
        if cow or num_new_blocks > 0:
            seq.shared_tail = False  # the last block was just taken from the free queue
        seq.num_slots = total
        seq.tail_room = room + num_new_blocks * bs - num_new_tokens
        if self.enable_prefix_caching and total // bs > len(seq.block_hashes):
            self._cache_full_blocks(seq, token_ids)
        return Allocation(new_ids, copies)

    def append_slot(self, seq_id: int, token_ids: Sequence[int],
                    num_pending: int = 0) -> Allocation | None:
        """allocate_slots(seq_id, token_ids, 1, num_pending=num_pending): the one-token decode
        step, same result and side effects. The common cases (a known GPU seq, its last block
        unshared, with room or full so that one new block opens) skip the general checks;
        every other case, errors and a full pool included, is allocate_slots'. (A whole
        batch of decodes: append_slots, the same cases without a call per sequence.)"""
        seq = self._seqs.get(seq_id)
        if seq is not None and not seq.shared_tail and not seq.swapped:
            num_slots = seq.num_slots
            if num_slots < len(token_ids) + num_pending:
                room = seq.tail_room
                if room:
                    seq.num_slots = num_slots + 1
                    seq.tail_room = room - 1
                    # (a block filled by a pending token is hashed when the next one opens)
                    if room == 1 and self.enable_prefix_caching and not num_pending:
                        self._cache_full_blocks(seq, token_ids)  # the last block just filled
                    return _NOTHING_NEW
                if self.gpu_pool.free_block_queue.num_free_blocks and self.block_size > 1:
                    return Allocation([self._open_block(seq, token_ids)], [])
        return self.allocate_slots(seq_id, token_ids, 1, num_pending=num_pending)

    def _open_block(self, seq: SeqBlocks, token_ids: Sequence[int]) -> int:
        """A decode slot that opens a new block (the last one is full and a block is free):
        hash the last block first if a pending token filled it. Returns the new block id."""
        if self.enable_prefix_caching and len(seq.block_hashes) < len(seq.block_ids):
            self._cache_full_blocks(seq, token_ids)  # filled ahead of its token
        block_id = self.gpu_pool.get_new_block().block_id
        seq.block_ids.append(block_id)
        seq.num_slots += 1
        seq.tail_room = self.block_size - 1
        return block_id

    def append_slots(self, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]],
                     num_pending: int, opened: dict[int, list[int]]) -> int:
        """One decode slot for each sequence in order, as append_slot gives it, for as long as
        each is the common case: a known GPU seq whose last block it owns alone, with room in
        that block or a free block to open. Stops at the first sequence that is not, untouched,
        and returns how many were done; the id of each new block goes into `opened[seq_id]`.
        The rest of a decode batch is append_slot's (copy-on-write, a full pool).

        The caller guarantees what append_slot checks: each slot is for the sequence's last
        known token (num_pending=0) or for the one in flight after it (num_pending=1), i.e.
        num_slots == len(token_ids) - 1 + num_pending. token_ids are read only to hash the
        blocks that fill."""
        if self.block_size == 1:
            return 0  # (every slot opens a block; allocate_slots' general path handles it)
        seqs_get = self._seqs.get
        caching = self.enable_prefix_caching
        free_queue = self.gpu_pool.free_block_queue
        cache_full_blocks = self._cache_full_blocks
        open_block = self._open_block
        hash_filled = caching and not num_pending
        for i, (seq_id, token_ids) in enumerate(zip(seq_ids, token_lists)):
            seq = seqs_get(seq_id)
            if seq is None or seq.shared_tail or seq.swapped:
                return i
            room = seq.tail_room
            if room:
                seq.num_slots += 1
                seq.tail_room = room - 1
                # (a block filled by a pending token is hashed when the next one opens)
                if room == 1 and hash_filled:
                    cache_full_blocks(seq, token_ids)  # the last block just filled
                continue
            if not free_queue.num_free_blocks:
                return i
            opened[seq_id] = [open_block(seq, token_ids)]  # the last block is full
        return len(seq_ids)

    def _allocate_new(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        prefix_block_ids: Sequence[int],
        extra_key: bytes | None,
        admit: bool,
        known_hashes: Sequence[BlockHash],
    ) -> Allocation | None:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if extra_key is not None and not isinstance(extra_key, bytes):
            raise ValueError(f"extra_key must be bytes or None, got {type(extra_key).__name__}")
        bs = self.block_size
        num_prefix = len(prefix_block_ids)
        total = num_prefix * bs + num_new_tokens
        if total > len(token_ids):
            raise ValueError(
                f"seq {seq_id}: {num_prefix} prefix blocks + {num_new_tokens} new tokens need "
                f"{total} token ids, got {len(token_ids)}"
            )
        pool = self.gpu_pool
        hashes: list[BlockHash] = []
        if num_prefix:
            if not self.enable_prefix_caching:
                raise ValueError("prefix_block_ids given but prefix caching is disabled")
            if num_prefix > (len(token_ids) - 1) // bs:
                raise ValueError(
                    f"seq {seq_id}: {num_prefix} prefix blocks cover the last token; at most "
                    f"{(len(token_ids) - 1) // bs} (use lookup_prefix)"
                )
        prefix_blocks: list[KVCacheBlock] = []
        revive = 0
        if self.enable_prefix_caching:
            hashes = self._full_block_hashes(token_ids, total // bs, extra_key, known_hashes)
            if num_prefix:
                prefix_blocks = self._prefix_blocks(prefix_block_ids, hashes, known_hashes)
                revive = list(map(_ref_cnt, prefix_blocks)).count(0)
        num_new_blocks = -(-total // bs) - num_prefix
        needed = num_new_blocks + revive
        free = pool.free_block_queue.num_free_blocks
        if needed > free or (admit and free - needed < self.watermark_blocks):
            return None
        if prefix_blocks:
            pool.touch(prefix_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks, hashes[num_prefix:] if num_prefix else hashes)
        new_ids = list(map(_block_id, new_blocks))
        table = list(prefix_block_ids) + new_ids if num_prefix else new_ids.copy()
        self._seqs[seq_id] = SeqBlocks(table, total, hashes, extra_key, tail_room=-total % bs,
                                  known_hashes=known_hashes)
        if self.enable_prefix_caching:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += num_prefix * bs
        return Allocation(new_ids, [])

    def _prefix_blocks(self, prefix_block_ids: Sequence[int], hashes: list[BlockHash],
                       known_hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """The blocks of prefix_block_ids: lookup_prefix's own when they are (a prefix of) what
        it just returned for the same hashes object with no eviction since, else checked."""
        last, self._last_hit = self._last_hit, None
        if (last is not None and last.block_hashes is known_hashes
                and last.evictions == self.gpu_pool.num_evictions):
            n = len(prefix_block_ids)
            ids = prefix_block_ids if type(prefix_block_ids) is list else list(prefix_block_ids)
            if n <= len(last.ids) and ids == (last.ids if n == len(last.ids) else last.ids[:n]):
                return last.blocks if n == len(last.blocks) else last.blocks[:n]
        return self._check_prefix(prefix_block_ids, hashes)

    def _check_prefix(self, prefix_block_ids: Sequence[int], hashes: list[BlockHash]) -> list[KVCacheBlock]:
        """The prefix blocks, after checking that each still holds its position's chained hash."""
        pool = self.gpu_pool
        n = len(prefix_block_ids)
        blocks = pool.blocks
        if 0 <= min(prefix_block_ids) and max(prefix_block_ids) < self.num_gpu_blocks:
            prefix_blocks = [blocks[b] for b in prefix_block_ids]
            if list(map(_block_hash, prefix_blocks)) == hashes[:n]:
                return prefix_blocks
        for i, bid in enumerate(prefix_block_ids):
            if not 0 <= bid < self.num_gpu_blocks or blocks[bid].block_hash != hashes[i]:
                raise ValueError(
                    f"prefix block {bid} (position {i}) no longer holds this prompt's KV; "
                    "call lookup_prefix right before allocate_slots"
                )
        raise AssertionError("unreachable: the batched prefix check failed but no block differs")

    def _cache_full_blocks(self, seq: SeqBlocks, token_ids: Sequence[int]) -> None:
        """Hash and cache the seq's blocks that became full since the last call, as far as
        token_ids reaches (a block filled ahead of its token waits for a later call)."""
        bs = self.block_size
        hashes = seq.block_hashes
        pool = self.gpu_pool
        blocks = pool.blocks
        table = seq.block_ids
        num_slots, num_known = seq.num_slots, len(token_ids)
        start, stop = len(hashes), (num_slots if num_slots < num_known else num_known) // bs
        known = seq.known_hashes
        if stop <= start:
            return
        if stop - start == 1:  # a decode step (or a short chunk) filled one block
            h = known[start] if len(known) > start else self._hash_block(
                hashes[-1] if hashes else None, token_ids[start * bs : stop * bs], seq.extra_key)
            hashes.append(h)
            pool.cache_block(blocks[table[start]], h)
            return
        if len(known) >= stop:  # a prefill chunk of a prompt hashed on arrival
            new = known[start:stop]
            hashes += new
        else:
            new_start = len(hashes)
            hash_packed_blocks(pack_token_ids(token_ids[start * bs : stop * bs]), bs, 0, stop - start,
                               hashes[-1] if hashes else None, seq.extra_key, hashes)
            new = hashes[new_start:]
        pool.cache_blocks([blocks[b] for b in table[start:stop]], new)

    # ---- per-seq queries ------------------------------------------------------------------

    def num_slots(self, seq_id: int) -> int:
        seq = self._seqs.get(seq_id)
        return 0 if seq is None else seq.num_slots

    def block_table(self, seq_id: int) -> list[int]:
        """The seq's live block table (GPU ids, or CPU ids while swapped); do not mutate."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown seq {seq_id}")
        return seq.block_ids

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def is_swapped(self, seq_id: int) -> bool:
        seq = self._seqs.get(seq_id)
        return seq is not None and seq.swapped

    # ---- fork / free ----------------------------------------------------------------------

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares every block of the parent (ref_cnt += 1) and its hash chain; the
        first write into a shared partially filled block copies it (allocate_slots)."""
        parent = self._seqs.get(parent_seq_id)
        if parent is None:
            raise ValueError(f"cannot fork unknown seq {parent_seq_id}")
        if child_seq_id in self._seqs:
            raise ValueError(f"cannot fork into seq {child_seq_id}: it already exists")
        pool = self.cpu_pool if parent.swapped else self.gpu_pool
        pool.touch(pool.blocks[b] for b in parent.block_ids)
        parent.shared_tail = True
        self._seqs[child_seq_id] = SeqBlocks(
            list(parent.block_ids), parent.num_slots, list(parent.block_hashes),
            parent.extra_key, parent.swapped, shared_tail=True, tail_room=parent.tail_room,
            known_hashes=parent.known_hashes,
        )

    def free(self, seq_id: int) -> None:
        """Release the seq's blocks tail-first so shared prefixes are evicted last.

        Unknown ids are ignored (a request may be aborted before it was ever allocated).
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        pool = self.cpu_pool if seq.swapped else self.gpu_pool
        blocks = pool.blocks
        pool.free_blocks(blocks[b] for b in reversed(seq.block_ids))

    # ---- stats / invariants ---------------------------------------------------------------

    def reset(self) -> None:
        """Forget every sequence and every cached block: the workers' caches are empty again
        (the engine rebuilt its tensor-parallel group after a rank died)."""
        self.gpu_pool = BlockPool(self.num_gpu_blocks, enable_caching=self.enable_prefix_caching)
        self.cpu_pool = BlockPool(self.num_cpu_blocks, enable_caching=False)
        self._seqs.clear()
        self._last_hit = None

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_gpu_blocks=self.num_gpu_blocks,
            num_free_gpu_blocks=self.num_free_gpu_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            num_free_cpu_blocks=self.num_free_cpu_blocks,
            gpu_usage=self.gpu_pool.usage(),
            cpu_usage=self.cpu_pool.usage(),
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            evictions=self.gpu_pool.num_evictions,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first violation: every block is free xor referenced,
        ref counts equal the number of tables holding the block, the cache map only points at
        blocks whose hash matches, free counts add up, tables match num_slots."""
        check_manager_invariants(self)
