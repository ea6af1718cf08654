"""SessionHolds: the sessions between turns a prefix-aware router counts on their replicas.

A session is a routing key (OpenAI's `prompt_cache_key`, else the `X-Session-Id` header).
After one of its turns completes on a replica, the session stays held there, as one request
of load, for `hold_s` seconds or until its next turn arrives (then it counts as that request);
a client thinking or a tool running will be back (cluster/api/prefix_router.py's policy,
step 2). Invariants: a key is held on one replica at most; a replica's holds are kept oldest
first, so expiry and the count against a report walk only the ends; a replica that leaves
takes its holds with it. One per PrefixAwareRouter, changed only through its hooks, like the
rest of its per-request state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class SessionHolds:
    """Sessions between turns (the module docstring): per replica its routing keys
    and when each one's last turn completed there, oldest first; a key is held on one replica
    at most, for `hold_s` seconds (0: never)."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        # replica -> key -> (when its turn completed, from when it counts), oldest first
        self._by_replica: dict[str, OrderedDict[str, tuple[float, float]]] = {}
        self._replica_of: dict[str, str] = {}

    def hold(self, key: str, replica: str, now: float, counted: bool = False) -> None:
        """`counted`: the replica's last report already showed its turn done, so it counts
        at once (else only against a report asked for after `now`)."""
        if self.hold_s > 0:
            self.end(key)
            self._by_replica.setdefault(replica, OrderedDict())[key] = (
                now, float("-inf") if counted else now)
            self._replica_of[key] = replica

    def end(self, key: str) -> None:
        replica = self._replica_of.pop(key, None)
        if replica is not None:
            held = self._by_replica[replica]
            del held[key]
            if not held:
                del self._by_replica[replica]

    def retain(self, replicas: Iterable[str]) -> None:
        """Holds on replicas not among these end (the replica left or died)."""
        keep = set(replicas)
        for replica in [r for r in self._by_replica if r not in keep]:
            for key in self._by_replica.pop(replica):
                del self._replica_of[key]

    def counts(self, now: float, reported_at: dict[str, float | None]) -> dict[str, int]:
        """Sessions held per replica, ended holds dropped. A turn that completed after the
        poll of the replica's last report was sent is left out: that report may still count
        its request (reported_at None: no report, every hold counts)."""
        out = {}
        for replica, held in list(self._by_replica.items()):
            while held and next(iter(held.values()))[0] + self.hold_s <= now:
                del self._replica_of[held.popitem(last=False)[0]]
            if not held:
                del self._by_replica[replica]
                continue
            n, since = len(held), reported_at.get(replica)
            if since is not None:
                for completed, counts_from in reversed(held.values()):
                    if completed < since:
                        break
                    n -= counts_from >= since
            out[replica] = n
        return out
