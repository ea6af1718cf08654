"""RequestQueues: every unfinished request, where it stands, and every move between queues.

Invariants between scheduler calls: each unfinished request is in `requests` and in exactly
one queue: `waiting` (WAITING and PREEMPTED, recompute victims at the front), `running`
(RUNNING, in (re)admission order, so the victim end is the tail), `swapped` (SWAPPED, the most recent victim first); `seqs`
maps the id of every live sequence to it and its request; `drops` is the list of sequence ids
whose worker state the next plan drops (the StepBuilder of that plan appends to it too).
A running request's live sequences number at most `max_num_seqs` in all (the scheduler's
admission checks keep it so). The decode lane is told (`evict`) whenever a request leaves the
running queue or one of its sequences finishes. A running request with a LoRA adapter pins it in
its device slot (scheduler/lora.py): pinned on entering `running`, released on leaving it.
"""

from __future__ import annotations

from collections import deque

from kvcache import KVCacheManager
from scheduler.decode_lane import DecodeLane
from scheduler.lora import LoRASlots
from scheduler.outputs import QueueLoad
from scheduler.request import Request, Seq, SequenceStatus

_RUNNING = SequenceStatus.RUNNING
_PREEMPTED = SequenceStatus.PREEMPTED
_SWAPPED = SequenceStatus.SWAPPED


class RequestQueues:
    def __init__(self, kv: KVCacheManager, lane: DecodeLane, lora: LoRASlots) -> None:
        self.kv = kv
        self.lane = lane
        self.lora = lora
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, tuple[Request, Seq]] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.drops: list[int] = []

    def add(self, req: Request) -> None:
        """A new request, at the back of the waiting queue."""
        self.requests[req.request_id] = req
        self.add_seqs(req, req.seqs)
        self.waiting.append(req)

    def add_seqs(self, req: Request, seqs: list[Seq]) -> None:
        for seq in seqs:
            self.seqs[seq.seq_id] = (req, seq)

    # ---- moves --------------------------------------------------------------------------

    def admit(self) -> Request:
        """The head of the waiting queue starts (or resumes) running."""
        req = self.waiting.popleft()
        req.move(_RUNNING)
        self.running.append(req)
        self._pin(req)
        return req

    def resume_swapped(self) -> Request:
        """The head of the swapped queue runs again (its blocks are being swapped in)."""
        req = self.swapped.popleft()
        req.move(_RUNNING)
        self.running.append(req)
        self._pin(req)
        return req

    def swapped_to_waiting(self) -> Request:
        """The head of the swapped queue goes to the front of the waiting queue, PREEMPTED
        (to recompute; the caller frees its KV)."""
        req = self.swapped.popleft()
        req.move(_PREEMPTED)
        self.waiting.appendleft(req)
        return req

    def leave_running(self, req: Request, new: SequenceStatus) -> None:
        """A running request is preempted: out of the running queue, the workers drop its
        sequences, and it goes to the front of swapped (SWAPPED) or waiting (PREEMPTED)."""
        self.running.remove(req)
        self._unpin(req)
        self.lane.evict(req)
        for seq in req.live_seqs():
            if seq.on_worker:
                self.drops.append(seq.seq_id)
                seq.on_worker = False
        req.move(new)
        (self.swapped if new is _SWAPPED else self.waiting).appendleft(req)

    # ---- finishing ------------------------------------------------------------------------

    def release(self, seq: Seq) -> None:
        """Free the sequence's blocks and have the workers drop its state."""
        self.kv.free(seq.seq_id)
        if seq.on_worker:
            self.drops.append(seq.seq_id)
            seq.on_worker = False

    def finish_seq(self, req: Request, seq: Seq, status: SequenceStatus,
                   stop_reason: str | int | None = None) -> bool:
        """Finish one sequence: its blocks and worker state go, a later plan's token for it is
        ignored, and its request finishes (and is forgotten) with its last sequence. Returns
        whether the request finished."""
        self.release(seq)
        seq.stop_reason = stop_reason
        self.lane.evict(req)
        before = req.status
        self.seqs.pop(seq.seq_id, None)
        if not req.finish_seq(seq, status):
            return False
        if before is _RUNNING:
            self.running.remove(req)
            self._unpin(req)
        else:  # preempted with its last token in flight (async scheduling)
            (self.swapped if before is _SWAPPED else self.waiting).remove(req)
        self.forget(req)
        return True

    def abort(self, request_id: str) -> Request | None:
        """Finish a request in any state now, freeing its blocks; None for an unknown id."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.lane.evict(req)
        status = req.status
        if status is _RUNNING:
            self.running.remove(req)
            self._unpin(req)
        elif status is _SWAPPED:
            self.swapped.remove(req)
        else:
            self.waiting.remove(req)
        for seq in req.live_seqs():
            self.release(seq)
        req.move(SequenceStatus.FINISHED_ABORTED)
        self.forget(req)
        return req

    def _pin(self, req: Request) -> None:
        """The request runs: its adapter (placed before admission) stays in its slot."""
        if req.lora_id:
            req.lora_slot = self.lora.slot_of[req.lora_id]
            self.lora.pin(req.lora_id)

    def _unpin(self, req: Request) -> None:
        if req.lora_id:
            self.lora.unpin(req.lora_id)
            req.lora_slot = -1

    def forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        for seq in req.seqs:
            self.seqs.pop(seq.seq_id, None)

    def requeue_all(self) -> None:
        """The workers lost every sequence (the engine rebuilt them; the KV cache is reset):
        every unfinished request goes back to waiting, the ones that had run at the front in
        admission order, to recompute its prompt and the tokens it has. No drops are owed."""
        back = self.running + list(self.swapped)
        back += [r for r in self.waiting if r.status is _PREEMPTED]
        fresh = [r for r in self.waiting if r.status is not _PREEMPTED]
        for req in back:
            if req.status is _RUNNING:
                self._unpin(req)
            self.lane.evict(req)
            for seq in req.live_seqs():
                seq.num_computed = 0
                seq.on_worker = False
            if req.status is not _PREEMPTED:
                req.move(_PREEMPTED)
        self.running, self.swapped = [], deque()
        self.waiting = deque(back + fresh)
        self.drops = []

    # ---- counts ---------------------------------------------------------------------------

    @staticmethod
    def reserved_seqs(req: Request) -> int:
        """Sequences the request occupies against max_num_seqs (n until it has forked)."""
        if not req.forked:
            return req.n
        return sum(1 for s in req.seqs if not s.status.is_finished)

    def num_running_seqs(self) -> int:
        return sum(self.reserved_seqs(r) for r in self.running)

    def load(self) -> QueueLoad:
        """Requests waiting and running, and the prompt tokens they still owe. A running
        sequence with more than one token left to compute is prefilling and owes them (one
        left is a decode); a waiting request owes its first live sequence's tokens (a
        recompute victim's outputs included) past its leading blocks that the prefix cache
        holds now or that a request ahead of it (a running prefill, or one waiting before
        it) will compute first, since admission will find those cached (at most all but the
        last token). Swapped requests owe nothing: they are copied back, not recomputed.
        O(running sequences + waiting requests x their prompt blocks), between scheduler calls
        only."""
        bs = self.kv.block_size
        owed = 0
        ahead: set = set()  # prompt blocks that requests ahead will have computed
        for req in self.running:
            for seq in req.seqs:
                left = req.target_len(seq) - seq.num_computed
                if seq.status is _RUNNING and left > 1:
                    owed += left
                    ahead.update(req.block_hashes[seq.num_computed // bs:])
        for req in self.waiting:
            seq = next((s for s in req.seqs if not s.status.is_finished), None)
            if seq is not None:
                n = len(seq.token_ids) - seq.num_computed
                hit = min(self.kv.num_cached_blocks(req.block_hashes, ahead), (n - 1) // bs)
                owed += n - max(0, hit) * bs
                ahead.update(req.block_hashes)
        return QueueLoad(len(self.waiting) + len(self.swapped), len(self.running), owed,
                         frozenset(self.requests))
