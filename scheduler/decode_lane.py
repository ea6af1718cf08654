"""The decode lane: the running sequences whose next step is a plain one-token decode, kept
as arrays so that step is scheduled in bulk instead of sequence by sequence.

A member is the only sequence of a request with n == 1 that the workers hold, that decoded
one token in the plan scheduled last, and that nothing has touched since but its own decodes
(see Scheduler._schedule_decodes for how it is used). The Sequence and the KV cache keep
the truth (num_computed, slots); the lane mirrors what deciding a step needs, and holds:
  - `reqs`, `seqs`, `seq_ids`, `token_lists`: the members in lane order, parallel lists
    (token_lists[i] is seqs[i].token_ids, the list object itself);
  - `ids`, `pos`, `max_len`: int64 numpy, each member's seq_id, num_computed and
    Sequence.max_len; `kind`: int8 numpy, PLAIN for a request with `plain` set, DEFERRABLE
    for one with `deferrable` set (its output fast paths in apply_result), else 0.
Every Request carries `in_lane`. A request leaves the lane by `evict` (preempted, finished,
aborted): its flag drops at once and its entries at the next `settle`; `clear` empties it.
"""

from __future__ import annotations

from itertools import compress
from operator import attrgetter

import numpy as np

from scheduler.request import Request, Sequence, SequenceStatus

_in_lane = attrgetter("in_lane")
PLAIN = 1
DEFERRABLE = 2


class DecodeLane:
    __slots__ = ("reqs", "seqs", "seq_ids", "token_lists", "ids", "pos", "max_len", "kind",
                 "_joined_pos", "_joined_max_len", "_joined_kind", "_evicted", "departures")

    def __init__(self) -> None:
        self.reqs: list[Request] = []
        self.seqs: list[Sequence] = []
        self.seq_ids: list[int] = []
        self.token_lists: list[list[int]] = []
        self.ids = np.zeros(0, dtype=np.int64)
        self.pos = np.zeros(0, dtype=np.int64)
        self.max_len = np.zeros(0, dtype=np.int64)
        self.kind = np.zeros(0, dtype=np.int8)
        self._joined_pos: list[int] = []  # of members joined since the last settle
        self._joined_max_len: list[int] = []
        self._joined_kind: list[int] = []
        self._evicted = 0  # members evicted since the last settle
        self.departures = 0  # members ever evicted or cleared (changes when any leaves)

    def __len__(self) -> int:
        """Members, evicted ones included until the next settle."""
        return len(self.reqs)

    def join(self, req: Request, seq: Sequence) -> None:
        """Add a sequence just scheduled as a plain decode (num_computed already advanced)."""
        req.in_lane = True
        self.reqs.append(req)
        self.seqs.append(seq)
        self.seq_ids.append(seq.seq_id)
        self.token_lists.append(seq.token_ids)
        self._joined_pos.append(seq.num_computed)
        self._joined_max_len.append(seq.max_len)
        self._joined_kind.append(PLAIN if req.plain else DEFERRABLE if req.deferrable else 0)

    def evict(self, req: Request) -> None:
        if req.in_lane:
            req.in_lane = False
            self._evicted += 1
            self.departures += 1

    def evict_rows(self, rows: list[int]) -> None:
        for i in rows:
            self.evict(self.reqs[i])
        self.settle()

    def clear(self) -> None:
        for req in self.reqs:
            req.in_lane = False
        self.departures += len(self.reqs)
        self.reqs, self.seqs, self.seq_ids, self.token_lists = [], [], [], []
        self.ids = np.zeros(0, dtype=np.int64)
        self.pos = np.zeros(0, dtype=np.int64)
        self.max_len = np.zeros(0, dtype=np.int64)
        self.kind = np.zeros(0, dtype=np.int8)
        self._joined_pos, self._joined_max_len, self._joined_kind = [], [], []
        self._evicted = 0

    def settle(self) -> None:
        """Take in the members joined and drop the ones evicted since the last call."""
        if self._joined_pos:
            self.ids = np.array(self.seq_ids, dtype=np.int64)
            self.pos = np.concatenate((self.pos, np.array(self._joined_pos, dtype=np.int64)))
            self.max_len = np.concatenate((self.max_len,
                                           np.array(self._joined_max_len, dtype=np.int64)))
            self.kind = np.concatenate((self.kind, np.array(self._joined_kind, dtype=np.int8)))
            self._joined_pos, self._joined_max_len, self._joined_kind = [], [], []
        if self._evicted:
            keep = np.fromiter(map(_in_lane, self.reqs), bool, len(self.reqs))
            self.reqs = list(compress(self.reqs, keep))
            self.seqs = list(compress(self.seqs, keep))
            self.seq_ids = list(compress(self.seq_ids, keep))
            self.token_lists = list(compress(self.token_lists, keep))
            self.ids = self.ids[keep]
            self.pos = self.pos[keep]
            self.max_len = self.max_len[keep]
            self.kind = self.kind[keep]
            self._evicted = 0

    def check(self, running: list[Request], kv_num_slots) -> None:
        """Assert the lane agrees with the scheduler's truth (tests call this between steps)."""
        live = [i for i, r in enumerate(self.reqs) if r.in_lane]
        assert len(live) + self._evicted == len(self.reqs), "evicted count is off"
        pos = np.concatenate((self.pos, np.array(self._joined_pos, dtype=np.int64)))
        max_len = np.concatenate((self.max_len, np.array(self._joined_max_len, dtype=np.int64)))
        kind = np.concatenate((self.kind, np.array(self._joined_kind, dtype=np.int8)))
        assert (len(pos) == len(max_len) == len(kind) == len(self.reqs) == len(self.seqs)
                == len(self.seq_ids) == len(self.token_lists))
        running_ids = {id(r) for r in running}
        flagged = [r for r in running if r.in_lane]
        assert len(flagged) == len(live), "a running request flagged in_lane is not a member"
        for i in live:
            req, seq = self.reqs[i], self.seqs[i]
            assert id(req) in running_ids, f"lane member {req.request_id!r} is not running"
            assert req.n == 1 and req.seqs[0] is seq and seq.status is SequenceStatus.RUNNING
            assert seq.on_worker and self.seq_ids[i] == seq.seq_id
            assert i >= len(self.ids) or self.ids[i] == seq.seq_id
            assert self.token_lists[i] is seq.token_ids
            assert pos[i] == seq.num_computed == kv_num_slots(seq.seq_id), (
                f"lane position of seq {seq.seq_id}: {pos[i]}, computed {seq.num_computed}")
            assert max_len[i] == seq.max_len
            assert kind[i] == (PLAIN if req.plain else DEFERRABLE if req.deferrable else 0)
