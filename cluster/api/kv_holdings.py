"""What each LLMServer replica's prefix cache holds, as a router in front of them sees it.

One `ReplicaHoldings` per replica: the block hashes it holds per medium (a set each), kept
exact by applying the replica's own `KVEventLog` answers in order (kvcache/events.py), plus
the hashes this router sent it in the last `recent_ttl_s` seconds, which count as held until
the events catch up (so a burst of one new prefix does not scatter before the first events
arrive); and the queued work the replica reported with its last answer (`QueueLoad`:
requests waiting and running, prompt tokens owed, the ids of its requests), and the LoRA
adapters it has loaded (as it reported them, plus those this router just sent it requests
for, which it loads on arrival; for `recent_ttl_s`). `HoldingsView` is
the set of them for one deployment: the router's process keeps one per deployment, shared by
its request routers and the poller that feeds it.

A replica that leaves the view (Serve stopped or replaced it, its actor died) takes its
holdings with it; one whose log has a new epoch (a restarted engine in the same replica)
sends a snapshot, whose CLEARED entries drop everything first. Hashes are never trusted
beyond what the replica's log or this router's own recent routing says.

Thread-safe: Serve may call a router's hooks from its long-poll thread while the routing loop
reads; one lock guards every change and every lookup.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvcache.events import CLEARED, CPU, DEVICE, EVICTED, STORED, KVEventBatch
from kvcache.hashing import BlockHash
from scheduler.outputs import QueueLoad

# A block held only in a CPU tier costs a copy back to the device, not a recompute, and may
# be gone by then: it counts this much of a device block when routing.
TIER_WEIGHT = {DEVICE: 1.0, CPU: 0.5}
# How long a routed request's hashes count as held without the replica confirming them.
DEFAULT_RECENT_TTL_S = 5.0


class ReplicaHoldings:
    """One replica's held hashes per medium, its log cursor and its recently routed hashes."""

    __slots__ = ("epoch", "seq", "held", "recent", "load", "reported_at", "loras",
                 "recent_loras")

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.seq = 0
        self.held: dict[str, set[BlockHash]] = {DEVICE: set(), CPU: set()}
        self.recent: dict[BlockHash, float] = {}  # hash -> when it stops counting
        self.load: QueueLoad | None = None  # its queued work, as it last reported
        self.reported_at: float | None = None  # when the poll it answered was sent
        self.loras: frozenset[str] = frozenset()  # the adapters it reported loaded
        self.recent_loras: dict[str, float] = {}  # adapter routed here -> when it stops counting

    def apply(self, batch: KVEventBatch) -> None:
        for _, op, medium, hashes in batch.entries:
            held = self.held.setdefault(medium, set())
            if op == STORED:
                held.update(hashes)
            elif op == EVICTED:
                held.difference_update(hashes)
            elif op == CLEARED:
                held.clear()
                self.recent.clear()
        self.epoch, self.seq = batch.epoch, batch.seq

    def leading_blocks(self, hashes: Sequence[BlockHash], now: float) -> float:
        """Leading blocks of `hashes` held, each weighted by its best tier (0.0 for none)."""
        device, cpu, recent = self.held[DEVICE], self.held.get(CPU, ()), self.recent
        score = 0.0
        for h in hashes:
            if h in device:
                score += 1.0
            elif (until := recent.get(h)) is not None and until > now:
                score += 1.0
            elif h in cpu:
                score += TIER_WEIGHT[CPU]
            else:
                break
        return score

    def expire(self, now: float) -> None:
        self.recent = {h: t for h, t in self.recent.items() if t > now}
        self.recent_loras = {n: t for n, t in self.recent_loras.items() if t > now}


class HoldingsView:
    """Holdings of every replica of one deployment, by Serve replica id (module docstring)."""

    def __init__(self, recent_ttl_s: float = DEFAULT_RECENT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.recent_ttl_s = recent_ttl_s
        self.clock = clock
        self._replicas: dict[str, ReplicaHoldings] = {}
        self._lock = threading.Lock()

    def replica_ids(self) -> list[str]:
        with self._lock:
            return list(self._replicas)

    def retain(self, replica_ids: Iterable[str]) -> None:
        """The replicas Serve routes to now: new ones start empty, the others are dropped."""
        keep = set(replica_ids)
        with self._lock:
            for rid in list(self._replicas):
                if rid not in keep:
                    del self._replicas[rid]
            for rid in keep:
                self._replicas.setdefault(rid, ReplicaHoldings())

    def drop(self, replica_id: str) -> None:
        with self._lock:
            self._replicas.pop(replica_id, None)

    def cursors(self) -> dict[str, tuple[str | None, int]]:
        """(epoch, seq) per replica, what `LLMServer.kv_events` takes."""
        with self._lock:
            return {rid: (r.epoch, r.seq) for rid, r in self._replicas.items()}

    def apply(self, replica_id: str, batch: KVEventBatch, load: QueueLoad,
              loras: Iterable[str] = (), as_of: float | None = None) -> None:
        """A replica's answer to a poll sent at `as_of` (the view's clock; None: now), with
        the adapters it has loaded; ignored for a replica no longer in the view (it died)."""
        now = self.clock()
        with self._lock:
            r = self._replicas.get(replica_id)
            if r is None:
                return
            r.apply(batch)
            r.load, r.reported_at = load, now if as_of is None else as_of
            r.loras = frozenset(loras)
            r.expire(now)

    def note_routed(self, replica_id: str, hashes: Sequence[BlockHash]) -> None:
        until = self.clock() + self.recent_ttl_s
        with self._lock:
            r = self._replicas.get(replica_id)
            if r is not None:
                r.recent.update(dict.fromkeys(hashes, until))

    def note_adapter(self, replica_id: str, lora_name: str) -> None:
        """A request under this adapter was just sent to the replica (it loads it there)."""
        until = self.clock() + self.recent_ttl_s
        with self._lock:
            r = self._replicas.get(replica_id)
            if r is not None:
                r.recent_loras[lora_name] = until

    def holding_adapter(self, lora_name: str, replica_ids: Iterable[str]) -> set[str]:
        """Which of the replicas have the adapter loaded (or were just sent it)."""
        now = self.clock()
        with self._lock:
            return {rid for rid in replica_ids if (r := self._replicas.get(rid)) is not None
                    and (lora_name in r.loras or r.recent_loras.get(lora_name, 0.0) > now)}

    def matches(self, hashes: Sequence[BlockHash],
                replica_ids: Iterable[str]) -> dict[str, float]:
        """Weighted leading blocks of `hashes` each replica holds (0.0 for unknown ones)."""
        now = self.clock()
        with self._lock:
            out = {}
            for rid in replica_ids:
                r = self._replicas.get(rid)
                out[rid] = r.leading_blocks(hashes, now) if r is not None else 0.0
            return out

    def loads(self) -> dict[str, QueueLoad | None]:
        """Per replica its last reported queued work (None before any)."""
        with self._lock:
            return {rid: r.load for rid, r in self._replicas.items()}

    def reported_at(self) -> dict[str, float | None]:
        """Per replica when the poll its last report answered was sent (None before any):
        the report holds nothing that ended before then, and may hold what ended after."""
        with self._lock:
            return {rid: r.reported_at for rid, r in self._replicas.items()}

    def sizes(self) -> dict[str, int]:
        """Device blocks each replica holds or was just sent (recent, expired or not)."""
        with self._lock:
            return {rid: len(r.held[DEVICE]) + len(r.recent) for rid, r in self._replicas.items()}

    def num_held(self, replica_id: str, medium: str = DEVICE) -> int:
        with self._lock:
            r = self._replicas.get(replica_id)
            return len(r.held.get(medium, ())) if r is not None else 0


class Shared:
    """One deployment's holdings in this process, fed by one poll task (prefix_router.py):
    every router of the deployment in the process (one per handle) reads the same view."""

    def __init__(self, recent_ttl_s: float) -> None:
        self.view = HoldingsView(recent_ttl_s)
        self.task: asyncio.Task | None = None
        self.last_routed = 0.0  # time.monotonic() of the last request routed


SHARED: dict[tuple[str, str], Shared] = {}  # (app, deployment) -> its holdings here
