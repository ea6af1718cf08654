"""KVCacheManager: per-sequence block tables over a GPU pool (with prefix caching) and a CPU
swap pool, with fork + copy-on-write for parallel sampling and group swap out/in.

One sequence's slots, after allocate_slots(seq, token_ids, k, num_pending=p) (block size 4):

    token_ids:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .. ..   (known)   then p pending (sampled
                                                                     by a step in flight)
    slots:    [ cached      | computed    | computed new  new ]  [ new  pend  -    -  ]
               '--------------------- num_slots ---------------------------'  tail_room
    cached:   the blocks of a prefix hit, shared by allocate_new (no KV computed for them)
    computed: slots reserved by earlier calls (their KV is written, or being written)
    new:      the k slots this call reserves; the step being planned writes their KV
    pending:  a new slot whose token is still in flight: the block it fills is hashed
              once that token is known (by the next call that reaches it)

Per-sequence state (invariants, checked by `check_invariants`):
  - len(block_ids) == ceil(num_slots / block_size); token i's KV lives in
    block_ids[i // block_size] at offset i % block_size; tail_room is the free slots of
    the last block;
  - with prefix caching every full block carries its chained hash, but for at most the last
    full block while its last token is pending (kvcache/prefix.py);
  - a swapped-out sequence's block_ids are CPU block ids.
Per-step cost is O(new tokens): a decode touches at most one new block and hashes at most one
full block, never the whole context.

A block is entered into the prefix cache when its slots are allocated, before the forward
pass writes its KV. That is safe because a sequence hitting it is in the same or a later
step, and every layer writes the whole batch's KV before attending.
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from operator import attrgetter

from kvcache import swap
from kvcache.block_pool import BlockPool
from kvcache.events import CPU, DEVICE, KVEventLog
from kvcache.hashing import BlockHash
from kvcache.invariants import check_manager_invariants
from kvcache.offload import OffloadTier
from kvcache.prefix import PrefixCache
from kvcache.rollback import rollback_slots
from kvcache.tables import NOTHING_NEW, Allocation, KVCacheStats, SeqBlocks

_block_id = attrgetter("block_id")
_ref_cnt = attrgetter("ref_cnt")


class KVCacheManager:
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
        num_offload_blocks: int = 0,  # > 0: the CPU tier of evicted prefix blocks (offload.py)
    ) -> None:
        if num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be > 0, got {num_gpu_blocks}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark is a fraction of GPU blocks in [0, 1), got {watermark}")
        if num_offload_blocks and not enable_prefix_caching:
            raise ValueError("a CPU offload tier finds blocks by their prefix hash: enable prefix "
                             "caching or give it no blocks (kv_offloading_size 0)")
        self.num_offload_blocks = num_offload_blocks
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark
        self.watermark_blocks = math.ceil(watermark * num_gpu_blocks)
        self._seqs: dict[int, SeqBlocks] = {}
        self.events = KVEventLog.of_pools(lambda: [(DEVICE, self.gpu_pool)] + (
            [(CPU, self.tier.pool)] if self.tier is not None else []))
        self.reset()

    def reset(self) -> None:
        """Forget every sequence and every cached block: the workers' caches are empty again
        (the engine rebuilt its tensor-parallel group after a rank died)."""
        self.events.cleared(DEVICE, CPU)  # what a router following `events` held is gone
        self.gpu_pool = BlockPool(self.num_gpu_blocks, self.enable_prefix_caching, self.events.sink())
        self.cpu_pool = BlockPool(self.num_cpu_blocks, enable_caching=False)
        self.prefix = PrefixCache(self.gpu_pool, self.block_size, self.enable_prefix_caching)
        self.tier = (OffloadTier(self.num_offload_blocks, self.events.sink())
                     if self.num_offload_blocks else None)
        self.gpu_pool.on_evict = self.tier and self.tier.offload
        self._seqs.clear()

    @property
    def num_free_gpu_blocks(self) -> int:
        """Free GPU blocks, cached ones included (they are evictable)."""
        return self.gpu_pool.free_block_queue.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.free_block_queue.num_free_blocks

    def lookup_prefix(self, token_ids: Sequence[int], extra_key: bytes | None = None,
                      block_hashes: Sequence[BlockHash] | None = None) -> list[int]:
        """GPU block ids of the longest cached full-block prefix of token_ids. Never covers
        the last token (at most (len(token_ids) - 1) // block_size blocks), so a
        request always has at least one token to compute. No side effects on blocks or stats.
        block_hashes, if given, must be prompt_block_hashes(token_ids[:k * block_size],
        block_size, extra_key) for some k (a request hashes its prompt once, on arrival); the
        lookup then hashes nothing and stops after k blocks. Without them the tokens are hashed
        here (and again by allocate_slots).
        """
        return self.prefix.lookup(token_ids, extra_key, block_hashes)

    def num_cached_blocks(self, block_hashes: Sequence[BlockHash], also: Container = ()) -> int:
        """Leading hashes of `block_hashes` the GPU prefix cache holds now or `also` has."""
        return self.prefix.num_cached(block_hashes, also)

    def lookup_offloaded(self, token_ids: Sequence[int], num_prefix_blocks: int,
                         extra_key: bytes | None = None,
                         block_hashes: Sequence[BlockHash] | None = None) -> list[int]:
        """Offload-tier block ids continuing a GPU prefix hit of num_prefix_blocks blocks, for
        allocate_new's offloaded_block_ids (otherwise as lookup_prefix); [] without a tier."""
        if self.tier is None:
            return []
        return self.tier.lookup(self.prefix, token_ids, num_prefix_blocks, extra_key, block_hashes)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The tier's copies since the last call, for the plan: (GPU, tier) offloads and
        (tier, GPU) loads (offload.py)."""
        return ([], []) if self.tier is None else self.tier.take_transfers()

    # ---- allocation -----------------------------------------------------------------------

    def num_blocks_needed(
        self, seq_id: int, num_new_tokens: int, prefix_block_ids: Sequence[int] = ()
    ) -> int:
        """Free GPU blocks allocate_new(seq_id, ..., num_new_tokens, prefix_block_ids) or, for a
        seq with blocks, allocate_slots(seq_id, ..., num_new_tokens) takes: new blocks +
        copy-on-write blocks + prefix blocks that sit in the free queue."""
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
            raise ValueError(f"seq {seq_id} already has blocks; a prefix is only for a new seq")
        num_slots = seq.num_slots
        needed = -(-(num_slots + num_new_tokens) // bs) - len(seq.block_ids)
        if num_new_tokens and num_slots % bs and self.gpu_pool.blocks[seq.block_ids[-1]].ref_cnt > 1:
            needed += 1
        return needed

    def allocate_new(self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int,
                     prefix_block_ids: Sequence[int] = (), extra_key: bytes | None = None,
                     admit: bool = False, block_hashes: Sequence[BlockHash] = (),
                     offloaded_block_ids: Sequence[int] = ()) -> Allocation | None:
        """A new sequence's first slots (see the diagram above): the blocks of its prefix hit,
        covering len(prefix_block_ids) * block_size tokens (they must come from lookup_prefix
        of the same tokens and extra_key, with no allocation between), then slots for
        num_new_tokens more. block_hashes (as for lookup_prefix: the chained hashes of some
        leading full blocks, usually the prompt's) spare hashing those blocks, now and when
        later chunks fill them. offloaded_block_ids (from lookup_offloaded right after that
        lookup) continue the prefix: each gets a new GPU block, loaded from the tier by this
        step's plan (take_transfers), and its tokens count as computed. Returns None and
        changes nothing when too few GPU blocks are free, or, with admit=True, when fewer
        than the watermark would remain free.
        """
        if seq_id in self._seqs:
            raise ValueError(f"seq {seq_id} already has blocks; allocate_new is only for a new "
                             "seq (grow it with allocate_slots)")
        return self._allocate_new(seq_id, token_ids, num_new_tokens, prefix_block_ids, extra_key,
                                  admit, block_hashes, offloaded_block_ids)

    def allocate_slots(self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int,
                       num_pending: int = 0) -> Allocation | None:
        """Reserve slots for the seq's next num_new_tokens tokens: the one way a sequence grows
        (prefill chunk, decode, verify row); an unknown seq is created. token_ids: the seq's
        known tokens, then num_pending unknown ones (in flight, or proposals being verified:
        see rollback_slots), whose blocks are hashed later. None (no change): too few free."""
        seq = self._seqs.get(seq_id)
        # The common decode: one slot, the last block the seq's own, with room or full (a new
        # block opens). Decided from small ints on the seq alone: touching the table or the
        # block (cache misses) or computing on token counts > 256 (heap ints) would grow with
        # the context.
        if num_new_tokens == 1 and seq is not None and not (seq.shared_tail or seq.swapped):
            num_slots = seq.num_slots
            if num_slots < len(token_ids) + num_pending:
                room = seq.tail_room
                if room > 1:
                    seq.num_slots = num_slots + 1
                    seq.tail_room = room - 1
                    return NOTHING_NEW
                alloc = self._edge_slot(seq, token_ids)
                if alloc is not None:
                    return alloc
        if seq is None:
            return self._allocate_new(seq_id, token_ids, num_new_tokens, (), None, False, (), ())
        return self._grow(seq_id, seq, token_ids, num_new_tokens, num_pending)

    def rollback_slots(self, seq_id: int, token_ids: Sequence[int], num_slots: int) -> int:
        """Give back the seq's slots from num_slots on (rejected proposals: kvcache/rollback.py),
        returning the blocks freed; token_ids (its known tokens) hash what accepted ones filled."""
        seq = self._seqs[seq_id]
        freed = rollback_slots(seq, self.gpu_pool, self.block_size, num_slots)
        if self.enable_prefix_caching:
            self.prefix.cache_full_blocks(seq, token_ids)
        return freed

    def allocate_decode_slots(self, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]],
                              num_pending: int, new_blocks: dict[int, list[int]]) -> int:
        """allocate_slots(seq_id, token_ids, 1, num_pending=num_pending) for each sequence in
        order (a decode batch), stopping untouched at the first sequence that is not on the
        GPU with its last block its own, or that allocate_slots refuses; returns how many were
        done, the id of each new block in new_blocks[seq_id]. The caller guarantees what
        allocate_slots would check: each slot is for a known token or a pending one
        (num_slots < len(token_ids) + num_pending)."""
        seqs_get = self._seqs.get
        edge_slot = self._edge_slot
        for i, (seq_id, token_ids) in enumerate(zip(seq_ids, token_lists)):
            seq = seqs_get(seq_id)
            if seq is None or seq.shared_tail or seq.swapped:
                return i
            room = seq.tail_room
            if room > 1:
                seq.num_slots += 1
                seq.tail_room = room - 1
                continue
            alloc = edge_slot(seq, token_ids)
            if alloc is None:
                return i
            if alloc is not NOTHING_NEW:
                new_blocks[seq_id] = alloc.new_block_ids
        return len(seq_ids)

    def _edge_slot(self, seq: SeqBlocks, token_ids: Sequence[int]) -> Allocation | None:
        """The common decode (allocate_slots and allocate_decode_slots) at a block's edge,
        for a seq on the GPU whose last block is its own: the last slot of that block, which
        is then hashed if its tokens are known (a block filled by a pending token is hashed
        when the next one opens), or the first slot of a new block. None, changing nothing,
        when no block is free (or blocks hold one token: the general path)."""
        num_slots = seq.num_slots
        if seq.tail_room:
            seq.num_slots = num_slots + 1
            seq.tail_room = 0
            if self.enable_prefix_caching and num_slots < len(token_ids):
                self.prefix.cache_full_blocks(seq, token_ids)  # the last block just filled
            return NOTHING_NEW
        pool = self.gpu_pool
        if not pool.free_block_queue.num_free_blocks or self.block_size == 1:
            return None
        if self.enable_prefix_caching and len(seq.block_hashes) < len(seq.block_ids):
            self.prefix.cache_full_blocks(seq, token_ids)  # the last block, filled ahead
        block_id = pool.get_new_block().block_id
        seq.block_ids.append(block_id)
        seq.num_slots = num_slots + 1
        seq.tail_room = self.block_size - 1
        return Allocation([block_id], [])

    def _grow(self, seq_id: int, seq: SeqBlocks, token_ids: Sequence[int], num_new_tokens: int,
              num_pending: int) -> Allocation | None:
        """allocate_slots for a seq that has blocks: every case, the common decode included."""
        if seq.swapped:
            raise ValueError(f"seq {seq_id} is swapped out; swap_in before allocating slots")
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
        bs = self.block_size
        table = seq.block_ids
        pool = self.gpu_pool
        room = seq.tail_room
        # from tail_room (small ints): ceil(total / bs) - len(table) and num_slots % bs != 0
        num_new_blocks = -((room - num_new_tokens) // bs)
        cow = num_new_tokens > 0 and room > 0 and seq.shared_tail and pool.blocks[table[-1]].ref_cnt > 1
        if num_new_blocks + cow > pool.free_block_queue.num_free_blocks:
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
            self.prefix.cache_full_blocks(seq, token_ids)
        if not (new_ids or copies):
            return NOTHING_NEW
        return Allocation(new_ids, copies)

    def _allocate_new(self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int,
                      prefix_block_ids: Sequence[int], extra_key: bytes | None, admit: bool,
                      known_hashes: Sequence[BlockHash], offloaded: Sequence[int]
                      ) -> Allocation | None:
        bs = self.block_size
        num_prefix = len(prefix_block_ids)
        num_hit = num_prefix + len(offloaded)
        total = num_hit * bs + num_new_tokens
        pool, prefix = self.gpu_pool, self.prefix
        prefix.check_new(seq_id, token_ids, num_new_tokens, extra_key, num_hit,
                         bool(offloaded) and self.tier is None)
        hashes: list[BlockHash] = []
        prefix_blocks, revive = [], 0
        if self.enable_prefix_caching:
            hashes = prefix.full_block_hashes(token_ids, total // bs, extra_key, known_hashes)
            if num_prefix:
                prefix_blocks = prefix.prefix_blocks(prefix_block_ids, hashes, known_hashes)
                revive = list(map(_ref_cnt, prefix_blocks)).count(0)
        num_new_blocks = -(-total // bs) - num_prefix
        needed = num_new_blocks + revive
        free = pool.free_block_queue.num_free_blocks
        if needed > free or (admit and free - needed < self.watermark_blocks):
            return None
        if offloaded:  # pinned before any eviction below can offload into them
            loaded = self.tier.check(offloaded, hashes[num_prefix:num_hit])
            self.tier.pin(loaded)
        if prefix_blocks:
            pool.touch(prefix_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks, hashes[num_prefix:] if num_prefix else hashes)
        new_ids = list(map(_block_id, new_blocks))
        if offloaded:
            self.tier.add_loads(loaded, new_ids[:len(offloaded)])
        table = list(prefix_block_ids) + new_ids if num_prefix else new_ids.copy()
        self._seqs[seq_id] = SeqBlocks(table, total, hashes, extra_key, tail_room=-total % bs,
                                       known_hashes=known_hashes)
        if self.enable_prefix_caching:
            prefix.queries += len(token_ids)
            prefix.hits += num_prefix * bs
            if self.tier is not None:
                self.tier.count(len(token_ids) - num_prefix * bs, len(offloaded) * bs)
        return Allocation(new_ids, [])

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
        """The child shares the parent's blocks (ref_cnt += 1) and hashes (copy on write)."""
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
        """Release the seq's blocks tail-first (shared prefixes are evicted last); unknown
        ids are ignored (a request may be aborted before it was ever allocated)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        pool = self.cpu_pool if seq.swapped else self.gpu_pool
        blocks = pool.blocks
        pool.free_blocks(blocks[b] for b in reversed(seq.block_ids))

    # ---- swap (kvcache/swap.py) -----------------------------------------------------------

    def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
        """Whether the CPU pool can hold every distinct GPU block of the group."""
        group = swap.group(self._seqs, seq_ids, swapped=False)
        return len(swap.distinct_blocks(group)) <= self.cpu_pool.num_free_blocks

    def can_swap_in(self, seq_ids: Sequence[int]) -> bool:
        """Whether the group fits on the GPU with the watermark still free."""
        group = swap.group(self._seqs, seq_ids, swapped=True)
        needed = len(swap.distinct_blocks(group))
        return self.gpu_pool.num_free_blocks - needed >= self.watermark_blocks

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move a group to CPU: (gpu, cpu) per distinct GPU block; GPU refs released tail-first."""
        group = swap.group(self._seqs, seq_ids, swapped=False)
        return swap.move(group, self.gpu_pool, self.cpu_pool, False, "swap_out", "CPU swap space")

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move a group back to GPU: (cpu, gpu) per distinct CPU block; full blocks re-cached."""
        group = swap.group(self._seqs, seq_ids, swapped=True)
        return swap.move(group, self.cpu_pool, self.gpu_pool, True, "swap_in", "free GPU blocks")

    # ---- stats / invariants ---------------------------------------------------------------

    def stats(self) -> KVCacheStats:
        return KVCacheStats.of(self)

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first violation (kvcache/invariants.py)."""
        check_manager_invariants(self)
