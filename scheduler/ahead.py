"""Async scheduling on the scheduler's side: plans scheduled ahead of the results they follow.

The engine may schedule plan N+1 while plan N runs, so that N+1 is ready the moment N ends.
At most MAX_PLANS_IN_FLIGHT plans await apply_result, and they are applied in the order they
were made. A sequence whose next token plan N samples then decodes that token in N+1 as
PENDING_TOKEN: the workers have it, the scheduler does not yet.

This module owns the plans in flight and every rule that follows from a token being in
flight; the rest of the scheduler asks here instead of testing for one itself:
  - `num_pending`: a sequence whose KV covers every token it knows has its next token in
    flight; its decode's input is PENDING_TOKEN (as StepBuilder.add and the decode lane write
    it), and its slot is reserved ahead (KVCacheManager.allocate_slots' `num_pending`), the
    block that slot fills being hashed once the token lands (kvcache/prefix.py);
  - `decode_pending` / `length_edge`: a sequence whose pending token would end it by length
    is not scheduled ahead (the decode lane applies the same rule to its arrays);
  - `waits_for_token`: a sequence that cannot grow while its token is in flight decides
    nothing (no finish for capacity) until that token has landed;
  - a token sampled for a sequence that finished meanwhile (a stop token in the plan before,
    or an abort) is dropped by apply_result: its sequence is no longer known;
  - a sequence preempted with a token in flight keeps it: the token lands and counts (swap
    keeps the KV it was computed from, recompute computes it again), and it may still finish
    the sequence from the swapped or waiting queue (RequestQueues.finish_seq).
Every plan that runs after another runs after it on the workers too, so blocks freed while a
plan is in flight can be handed out by the next plan: their old owner's writes come first.

Micro-batches (pipeline parallelism, `SchedulerConfig.micro_batches` = pp > 1): up to that
many plans are in flight, one per pipeline stage, and they are disjoint in what they sample:
a sequence with a token in flight is not scheduled again (no PENDING_TOKEN: the pending
tokens of async scheduling come from the plan just before, and their broadcast from the last
stage would make the first stage wait for it) until the plan carrying it has been applied.
A later prefill chunk of a sequence may follow an earlier one still in flight (it samples
nothing the earlier one decides; the workers run the plans in order). So that no stage waits,
each plan takes a 1 / micro_batches share of the sequences (`seq_slots`: at least the
largest n, a fork schedules its n at once); the decode lane,
whose members decode in every plan, does not run. A plan that preempted sets a barrier: no
request is resumed or admitted while a plan made before it is in flight (a sequence
preempted for recompute with its token in flight must not sample that token a second time).
With micro_batches = 1 every rule above is today's async scheduling, unchanged.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from scheduler.request import Seq

# The step being executed and the one scheduled ahead of its result (micro_batches = 1).
MAX_PLANS_IN_FLIGHT = 2
# DecodeLane's threshold with micro-batches: it never runs.
_NO_LANE = 1 << 62


class PlansInFlight:
    """Step ids of the plans schedule() made and apply_result() has not taken yet, oldest first,
    and the rules of `micro_batches` disjoint plans (see the module docstring)."""

    __slots__ = ("_ids", "micro_batches", "limit", "_barrier")

    def __init__(self, micro_batches: int = 1) -> None:
        self._ids: deque[int] = deque()
        self.micro_batches = micro_batches
        self.limit = micro_batches if micro_batches > 1 else MAX_PLANS_IN_FLIGHT
        self._barrier = 0  # the last plan that preempted

    @property
    def disjoint(self) -> bool:
        """Whether plans in flight sample disjoint sequences (micro-batches)."""
        return self.micro_batches > 1

    @property
    def num_in_flight(self) -> int:
        return len(self._ids)

    def lane_args(self, spec_args: tuple[int, ...]) -> tuple[int, ...]:
        """DecodeLane's arguments after the block size: none runs with micro-batches."""
        return (_NO_LANE,) if self.disjoint else spec_args

    def seq_slots(self, max_num_seqs: int, queues: object) -> int:
        """The sequences one plan may take: all of max_num_seqs, or with micro-batches a
        1 / micro_batches share of those running and queued, but never fewer than the largest
        n among them (a fork schedules its n sequences in one plan) nor more than max_num_seqs."""
        if not self.disjoint:
            return max_num_seqs
        reqs = (*queues.running, *queues.waiting, *queues.swapped)
        share = math.ceil(min(max_num_seqs, sum(r.n for r in reqs)) / self.micro_batches)
        return min(max_num_seqs, max(1, share, *(r.n for r in reqs)))

    def may_admit(self) -> bool:
        """Whether requests may be resumed or admitted: no plan made before the last plan
        that preempted is still in flight."""
        return not self._ids or self._ids[0] >= self._barrier

    def decode_pending(self, seq: Seq) -> int | None:
        """`decode_pending`, except that with micro-batches a token in flight is not decoded
        ahead (None)."""
        pending = decode_pending(seq)
        return None if pending and self.disjoint else pending

    @property
    def ahead(self) -> bool:
        """Whether a plan is in flight: the next one is scheduled ahead of its result."""
        return bool(self._ids)

    def check_room(self) -> None:
        """RuntimeError when MAX_PLANS_IN_FLIGHT already wait (before a plan is made)."""
        if len(self._ids) >= self.limit:
            raise RuntimeError(f"schedule() called with steps {list(self._ids)} in flight; "
                               f"at most {self.limit} plans may await apply_result()")

    def launch(self, step_id: int, preempted: bool = False) -> None:
        """A plan was made (`preempted`: it preempted a request)."""
        self._ids.append(step_id)
        if preempted:
            self._barrier = step_id

    def check_next(self, step_id: int) -> None:
        """RuntimeError unless step_id is the oldest plan in flight (results go in order)."""
        if not self._ids or self._ids[0] != step_id:
            raise RuntimeError(f"apply_result() for step {step_id}, but the plans awaiting "
                               f"results are {list(self._ids)} (apply them in order)")

    def land(self) -> None:
        """The oldest plan's result has been applied."""
        self._ids.popleft()

    def clear(self) -> None:
        """Forget every plan in flight (their results will never come)."""
        self._ids.clear()


def num_pending(seq: Seq) -> int:
    """1 when the sequence's next token is in flight (its KV covers every token it knows),
    else 0."""
    computed = seq.num_computed
    return 1 if computed and computed == len(seq.token_ids) else 0


def decode_pending(seq: Seq) -> int | None:
    """num_pending of the sequence's next one-token decode (0: its input is its last known
    token; 1: the token in flight), or None when it has no decode to schedule now (a
    prefill chunk left, a token in flight that ends it by length, or its tokens already
    being computed by the plans in flight)."""
    start = seq.num_computed
    num_known = len(seq.token_ids)
    if num_known - start == 1 and start:
        return 0
    if num_known == start and start + 1 < seq.max_len:
        return 1
    return None


def length_edge(pos: np.ndarray, max_len: np.ndarray) -> np.ndarray:
    """Over arrays of num_computed and max_len (the decode lane's): whether the token in
    flight ends the sequence by length, so that decode_pending would say None."""
    return pos + 1 >= max_len


def waits_for_token(seq: Seq) -> bool:
    """Whether a sequence that cannot grow must wait for its token in flight to land before
    anything is decided about it (see the module docstring)."""
    return num_pending(seq) == 1
