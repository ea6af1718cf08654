"""The prefix cache: which GPU blocks hold the KV of which chained block hashes.

Owns the lookup of a prompt's longest cached prefix, the hashing of a sequence's blocks as
they fill, and the hit counters. The map itself is the GPU BlockPool's
(`cached_block_hash_to_block`); this class decides what enters it and when.

Invariants: a sequence's `block_hashes[i]` is the chained hash of its full block i, and the
block carries it; the one exception is its last full block while the token that filled it
is still being sampled (async scheduling reserves that slot ahead): that block is hashed by
the next `cache_full_blocks` call that reaches a known token, so at most one block lags.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
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
from kvcache.tables import SeqBlocks

_block_id = attrgetter("block_id")
_block_hash = attrgetter("block_hash")


@dataclass(slots=True)
class _LastHit:
    """What the last lookup given a request's hashes found (see `prefix_blocks`)."""

    block_hashes: Sequence[BlockHash]
    evictions: int  # the GPU pool's eviction count then
    ids: list[int]
    blocks: list[KVCacheBlock]


class PrefixCache:
    """Prefix lookups and block hashing over one GPU pool (see the module docstring)."""

    def __init__(self, pool: BlockPool, block_size: int, enabled: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.hash_block = block_hasher(block_size)
        self._last_hit: _LastHit | None = None
        self.queries = 0  # prompt tokens looked up (cumulative)
        self.hits = 0  # prompt tokens served by cached blocks (cumulative)

    def lookup(self, token_ids: Sequence[int], extra_key: bytes | None,
               block_hashes: Sequence[BlockHash] | None) -> list[int]:
        """KVCacheManager.lookup_prefix (documented there)."""
        if not self.enabled:
            return []
        bs = self.block_size
        max_hit = (len(token_ids) - 1) // bs
        if max_hit <= 0:
            return []
        cache = self.pool.cached_block_hash_to_block
        given = block_hashes is not None
        if block_hashes is None:
            if self.hash_block(None, token_ids[:bs], extra_key) not in cache:
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
            # allocation with these very hashes and ids takes the blocks from here unchecked
            # while no block has been evicted since (then every one still holds its hash)
            self._last_hit = _LastHit(block_hashes, self.pool.num_evictions, ids, entries)
        return list(ids)

    def num_cached(self, block_hashes: Sequence[BlockHash], also: Container) -> int:
        """KVCacheManager.num_cached_blocks (documented there); no side effects."""
        cache = self.pool.cached_block_hash_to_block
        n = 0
        for h in block_hashes:
            if h not in cache and h not in also:
                break
            n += 1
        return n

    def check_new(self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int,
                  extra_key: bytes | None, num_hit: int, no_tier: bool) -> None:
        """Raise ValueError for a new sequence's allocation that cannot be: num_hit prefix
        blocks (GPU hits and offload-tier hits) then num_new_tokens more."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if extra_key is not None and not isinstance(extra_key, bytes):
            raise ValueError(f"extra_key must be bytes or None, got {type(extra_key).__name__}")
        bs = self.block_size
        total = num_hit * bs + num_new_tokens
        if total > len(token_ids):
            raise ValueError(f"seq {seq_id}: {num_hit} prefix blocks + {num_new_tokens} new tokens "
                             f"need {total} token ids, got {len(token_ids)}")
        if no_tier:
            raise ValueError("offloaded_block_ids given but there is no offload tier")
        if num_hit and not self.enabled:
            raise ValueError("prefix_block_ids given but prefix caching is disabled")
        if num_hit and num_hit > (len(token_ids) - 1) // bs:
            raise ValueError(f"seq {seq_id}: {num_hit} prefix blocks cover the last token; at most "
                             f"{(len(token_ids) - 1) // bs} (use lookup_prefix)")

    def full_block_hashes(self, token_ids: Sequence[int], num_full: int,
                          extra_key: bytes | None, known: Sequence[BlockHash]) -> list[BlockHash]:
        """Chained hashes of the first num_full blocks, the known ones taken as given."""
        hashes = list(known[:num_full])
        if len(hashes) < num_full:
            bs = self.block_size
            start = len(hashes)
            hash_packed_blocks(pack_token_ids(token_ids[start * bs : num_full * bs]), bs, 0,
                               num_full - start, hashes[-1] if hashes else None, extra_key, hashes)
        return hashes

    def prefix_blocks(self, prefix_block_ids: Sequence[int], hashes: list[BlockHash],
                      known_hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """The blocks of prefix_block_ids: the last lookup's own when they are (a prefix of)
        what it returned for the same hashes object with no eviction since, else checked."""
        last, self._last_hit = self._last_hit, None
        if (last is not None and last.block_hashes is known_hashes
                and last.evictions == self.pool.num_evictions):
            n = len(prefix_block_ids)
            ids = prefix_block_ids if type(prefix_block_ids) is list else list(prefix_block_ids)
            if n <= len(last.ids) and ids == (last.ids if n == len(last.ids) else last.ids[:n]):
                return last.blocks if n == len(last.blocks) else last.blocks[:n]
        return self.check(prefix_block_ids, hashes)

    def check(self, prefix_block_ids: Sequence[int], hashes: list[BlockHash]) -> list[KVCacheBlock]:
        """The prefix blocks, after checking that each still holds its position's chained hash."""
        n = len(prefix_block_ids)
        blocks = self.pool.blocks
        num_blocks = len(blocks)
        if 0 <= min(prefix_block_ids) and max(prefix_block_ids) < num_blocks:
            prefix_blocks = [blocks[b] for b in prefix_block_ids]
            if list(map(_block_hash, prefix_blocks)) == hashes[:n]:
                return prefix_blocks
        for i, bid in enumerate(prefix_block_ids):
            if not 0 <= bid < num_blocks or blocks[bid].block_hash != hashes[i]:
                raise ValueError(
                    f"prefix block {bid} (position {i}) no longer holds this prompt's KV; "
                    "call lookup_prefix right before allocate_slots"
                )
        raise AssertionError("unreachable: the batched prefix check failed but no block differs")

    def cache_full_blocks(self, seq: SeqBlocks, token_ids: Sequence[int]) -> None:
        """Hash and cache the seq's blocks that became full since the last call, as far as
        token_ids reaches (a block filled ahead of its token waits for a later call)."""
        bs = self.block_size
        hashes = seq.block_hashes
        pool = self.pool
        blocks = pool.blocks
        table = seq.block_ids
        num_slots, num_known = seq.num_slots, len(token_ids)
        start, stop = len(hashes), (num_slots if num_slots < num_known else num_known) // bs
        known = seq.known_hashes
        if stop <= start:
            return
        if stop - start == 1:  # a decode step (or a short chunk) filled one block
            h = known[start] if len(known) > start else self.hash_block(
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
