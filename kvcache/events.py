"""What a replica's prefix cache gains and loses, as an ordered log a router can follow.

A block pool that has a `KVEventLog` reports each block hash that enters its cache map
(STORED: the first block holding it) and each that leaves it (EVICTED: the last block holding
it was reused), in the order it happens; `KVCacheManager.reset` (the workers' caches were lost)
reports CLEARED. An entry is `(seq, op, medium, hashes)`: `medium` says which tier holds the
blocks (`DEVICE` today; a CPU tier for evicted prefix blocks reports as `CPU`, which a router
weighs lower), `hashes` are the chained block hashes of `kvcache/hashing.py`.

A follower keeps a cursor `(epoch, seq)` and calls `since(epoch, seq)`; it gets the entries
after `seq`, or, when it has none yet, when the log was made by another process (a restarted
replica: a new epoch), or when the entries it missed were trimmed, a snapshot: CLEARED for
every medium, then STORED of every hash held now. Either way, applying the answer in order to
"the set of hashes held per medium" leaves the follower's set equal to the cache map's keys.

Nobody following, nothing recorded: the pools get the log only once `since` was first called
(`on_follow`), so a replica that no router follows (one replica) pays nothing for it.

The log keeps at most `capacity` entries (one entry is one stored batch or one evicted hash),
so its memory is bounded whether or not anybody follows it. It is not thread-safe: the
replica's event loop appends (scheduling) and reads (answering a follower).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from kvcache.hashing import BlockHash

STORED, EVICTED, CLEARED = 0, 1, 2
DEVICE, CPU = "device", "cpu"

# Entries kept for followers that fall behind: beyond, they get a snapshot instead.
DEFAULT_CAPACITY = 65536

Entry = tuple[int, int, str, tuple[BlockHash, ...]]


@dataclass(slots=True)
class KVEventBatch:
    """The answer to `since`: apply `entries` in order, then resume from (epoch, seq)."""

    epoch: str
    seq: int
    entries: list[Entry]
    snapshot: bool  # entries start with CLEARED of every medium


class KVEventLog:
    """Ordered, bounded log of STORED / EVICTED / CLEARED block hashes (module docstring).

    Invariant: `seq` is the number of entries ever appended; the kept entries are the last
    ones, numbered seq - len(kept) + 1 .. seq.
    """

    def __init__(self, snapshot: Callable[[], dict[str, Sequence[BlockHash]]] | None = None,
                 capacity: int = DEFAULT_CAPACITY,
                 on_follow: Callable[[], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 entry, got {capacity}")
        self.epoch = os.urandom(8).hex()
        self.seq = 0
        self._entries: deque[Entry] = deque(maxlen=capacity)
        # What is held now, per medium; set by the owner of the pools (KVCacheManager).
        self.snapshot = snapshot or (lambda: {})
        self.followed = False  # since() was called: the owner now reports into the log
        self._on_follow = on_follow

    @classmethod
    def of_pools(cls, pools: Callable[[], Sequence[tuple[str, Any]]]) -> KVEventLog:
        """The log of what `pools` (medium, BlockPool) hold now: its snapshot is their cache
        maps, and once followed each pool reports into it."""
        log = cls(lambda: {m: list(p.cached_block_hash_to_block) for m, p in pools()})
        log._on_follow = lambda: [setattr(p, "events", log) for _, p in pools()]
        return log

    def sink(self) -> KVEventLog | None:
        """What a pool should report into: this log once followed, else nothing."""
        return self if self.followed else None

    def stored(self, medium: str, hashes: Sequence[BlockHash]) -> None:
        if hashes:
            self.seq += 1
            self._entries.append((self.seq, STORED, medium, tuple(hashes)))

    def evicted(self, medium: str, block_hash: BlockHash) -> None:
        self.seq += 1
        self._entries.append((self.seq, EVICTED, medium, (block_hash,)))

    def cleared(self, *media: str) -> None:
        if not self.followed:
            return
        for medium in media:
            self.seq += 1
            self._entries.append((self.seq, CLEARED, medium, ()))

    def since(self, epoch: str | None, seq: int) -> KVEventBatch:
        """What a follower whose cursor is (epoch, seq) must apply (module docstring)."""
        if not self.followed:
            self.followed = True
            if self._on_follow is not None:
                self._on_follow()
        entries = self._entries
        oldest = self.seq - len(entries) + 1
        if epoch == self.epoch and oldest <= seq + 1 and seq <= self.seq:
            return KVEventBatch(self.epoch, self.seq,
                                list(islice(entries, seq + 1 - oldest, None)), False)
        held = self.snapshot()
        out: list[Entry] = [(self.seq, CLEARED, m, ()) for m in (DEVICE, CPU)]
        out += [(self.seq, STORED, m, tuple(hashes)) for m, hashes in held.items() if hashes]
        return KVEventBatch(self.epoch, self.seq, out, True)
