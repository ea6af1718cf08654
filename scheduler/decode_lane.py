"""The decode lane: the running sequences whose next step is a plain one-token decode, kept
as arrays so that stage 1 of a step (scheduler/scheduler.py) schedules them in bulk.

A member is the only sequence of a request with n == 1 that the workers hold, that decoded
one token in the plan scheduled last, and that nothing has touched since but its own decodes.
So its next decode is known without looking at it: slot `pos` (its num_computed), input its
last token, or PENDING_TOKEN when the plan before is in flight (scheduler/ahead.py). Its
last block is its own (only a fork shares a partly filled block), so its slot never copies.
The Seq and the KV cache keep the truth; the lane mirrors what deciding a step needs:
  - `reqs`, `seqs`, `seq_ids`, `token_lists`: the members in lane order, parallel lists
    (token_lists[i] is seqs[i].token_ids, the list object itself);
  - `ids`, `pos`, `max_len`: int64 arrays of each member's seq_id, num_computed, max_len.
Every Request carries `in_lane`. A request leaves the lane by `evict` (preempted, finished,
aborted): its flag drops at once and its entries at the next `settle`; `clear` empties it.

When it runs (`schedule`), the lane is the whole of stage 1 for its members and the rest of
the running requests go one by one after it: only the batch order differs from scheduling
everyone one by one (the lane's rows come first). It runs only while that order cannot
matter: when the KV cache surely has every block stage 1 may ask for (`_fits`), so nobody is
preempted, and while at least `min_running` requests run (below, its fixed cost of some
twenty numpy calls outweighs what it saves).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress
from operator import attrgetter, itemgetter

import numpy as np

from kvcache import KVCacheManager
from scheduler.ahead import length_edge
from scheduler.plan import PENDING_TOKEN
from scheduler.request import Request, Seq, SequenceStatus
from scheduler.step_builder import StepBuilder

_in_lane = attrgetter("in_lane")
_last = itemgetter(-1)
LANE_MIN_RUNNING = 64


@dataclass(slots=True)
class LaneRows:
    """The lane rows a plan starts with, as apply_result reads them."""

    reqs: list[Request]
    seqs: list[Seq]
    token_lists: list[list[int]]  # each seq's token_ids
    pos: np.ndarray  # each member's num_computed before this plan's decode
    max_len: np.ndarray
    departures: int  # the lane's departure count when the plan was made; -1: cut short


class DecodeLane:
    def __init__(self, block_size: int, min_running: int = LANE_MIN_RUNNING) -> None:
        self.block_size = block_size
        # (with blocks of 1 token every decode opens a block: no lane)
        self.min_running = min_running if block_size > 1 else 1 << 62
        self.joining = False  # whether sequences that decode one by one join in this step
        self.steps = self.steps_cut = 0  # bulk steps made, and cut short (for tests)
        self.departures = 0  # members ever evicted or cleared (changes when any leaves)
        self._plans: dict[int, LaneRows] = {}
        self._empty()

    def __len__(self) -> int:
        """Members, evicted ones included until the next settle."""
        return len(self.reqs)

    # ---- stage 1 ------------------------------------------------------------------------

    def schedule(self, step: StepBuilder, running: list[Request], kv: KVCacheManager,
                 ahead: bool) -> list[Request]:
        """Schedule every member's decode when the lane runs this step (see the module
        docstring); return the running requests stage 1 still has to go through one by one,
        in order (all of them when the lane does not run)."""
        self.settle()
        self.joining = len(running) >= self.min_running
        if self.reqs and not self.joining:
            self.clear()  # too few running for the lane to pay
        if not self.reqs:
            return list(running)
        if ahead:  # their tokens in flight that end them by length are not computed ahead
            edge = np.flatnonzero(length_edge(self.pos, self.max_len))
            if edge.size:
                for i in edge.tolist():
                    self.evict(self.reqs[i])
                self.settle()
        outside = [r for r in running if not r.in_lane] if len(running) > len(self) else []
        if not self.reqs or not self._fits(outside, kv):
            self.clear()
            return list(running)
        return self._decode(step, kv, ahead) + outside

    def _fits(self, outside: list[Request], kv: KVCacheManager) -> bool:
        """Whether stage 1 surely gets every KV block it asks for: the lane's new blocks, and
        at most two per live sequence of the requests outside it (a fork: n + 1)."""
        need = int(np.count_nonzero(self.pos % self.block_size == 0))
        for req in outside:
            need += 2 * len(req.seqs) if req.forked else req.n + 1
        return need <= kv.num_free_gpu_blocks

    def _decode(self, step: StepBuilder, kv: KVCacheManager, ahead: bool) -> list[Request]:
        """Every member decodes one token; returns the members left undone (not expected:
        `_fits` held), the lane then emptied."""
        n = len(self.reqs)
        self.steps += 1
        done = kv.allocate_decode_slots(self.seq_ids, self.token_lists, int(ahead), step.appended)
        if ahead:
            inputs = np.full(done, PENDING_TOKEN, dtype=np.int64)
        else:
            inputs = np.fromiter(map(_last, self.token_lists[:done]), np.int64, done)
        reqs, seqs, pos = self.reqs[:done], self.seqs[:done], self.pos[:done].copy()
        step.lane = (self.ids[:done], pos, inputs)
        # (max_len is never changed in place: its slice stays as it is now)
        self._plans[step.step_id] = LaneRows(reqs, seqs, self.token_lists[:done], pos,
                                             self.max_len[:done],
                                             self.departures if done == n else -1)
        rest: list[Request] = []
        if done < n:
            self.steps_cut += 1
            rest = self.reqs[done:]
            self.clear()
        else:
            self.pos += 1
        step_id = step.step_id
        for req, seq in zip(reqs, seqs):
            seq.num_computed += 1
            req.scheduled_step = step_id
        step.budget -= done
        step.seq_slots -= done
        return rest

    def take_rows(self, step_id: int) -> LaneRows | None:
        """The lane rows plan step_id started with (None: it had none), for apply_result."""
        return self._plans.pop(step_id, None)

    # ---- membership ---------------------------------------------------------------------

    def join(self, req: Request, seq: Seq) -> None:
        """Add a sequence just scheduled as a plain decode (num_computed already advanced)."""
        req.in_lane = True
        self.reqs.append(req)
        self.seqs.append(seq)
        self.seq_ids.append(seq.seq_id)
        self.token_lists.append(seq.token_ids)
        self._joined_pos.append(seq.num_computed)
        self._joined_max_len.append(seq.max_len)

    def evict(self, req: Request) -> None:
        if req.in_lane:
            req.in_lane = False
            self._evicted += 1
            self.departures += 1

    def clear(self) -> None:
        for req in self.reqs:
            req.in_lane = False
        self.departures += len(self.reqs)
        self._empty()

    def _empty(self) -> None:
        self.reqs: list[Request] = []
        self.seqs: list[Seq] = []
        self.seq_ids: list[int] = []
        self.token_lists: list[list[int]] = []
        self.ids = np.zeros(0, dtype=np.int64)
        self.pos = np.zeros(0, dtype=np.int64)
        self.max_len = np.zeros(0, dtype=np.int64)
        self._joined_pos: list[int] = []  # of members joined since the last settle
        self._joined_max_len: list[int] = []
        self._evicted = 0  # members evicted since the last settle

    def reset(self) -> None:
        """Empty, with no plan's rows remembered (the plans in flight were forgotten)."""
        self.clear()
        self._plans.clear()

    def settle(self) -> None:
        """Take in the members joined and drop the ones evicted since the last call."""
        if self._joined_pos:
            self.ids = np.array(self.seq_ids, dtype=np.int64)
            self.pos = np.concatenate((self.pos, np.array(self._joined_pos, dtype=np.int64)))
            self.max_len = np.concatenate((self.max_len,
                                           np.array(self._joined_max_len, dtype=np.int64)))
            self._joined_pos, self._joined_max_len = [], []
        if self._evicted:
            keep = np.fromiter(map(_in_lane, self.reqs), bool, len(self.reqs))
            self.reqs = list(compress(self.reqs, keep))
            self.seqs = list(compress(self.seqs, keep))
            self.seq_ids = list(compress(self.seq_ids, keep))
            self.token_lists = list(compress(self.token_lists, keep))
            self.ids = self.ids[keep]
            self.pos = self.pos[keep]
            self.max_len = self.max_len[keep]
            self._evicted = 0

    def check(self, running: list[Request], kv_num_slots) -> None:
        """Assert the lane agrees with the scheduler's truth (tests call this between steps)."""
        live = [i for i, r in enumerate(self.reqs) if r.in_lane]
        assert len(live) + self._evicted == len(self.reqs), "evicted count is off"
        pos = np.concatenate((self.pos, np.array(self._joined_pos, dtype=np.int64)))
        max_len = np.concatenate((self.max_len, np.array(self._joined_max_len, dtype=np.int64)))
        assert (len(pos) == len(max_len) == len(self.reqs) == len(self.seqs)
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
