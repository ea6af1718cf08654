"""Parallel sampling's fork (n > 1): the children of a request's parent sequence.

n > 1 (parallel sampling): the parent sequence prefills the prompt except its last token; then
the n - 1 children are forked from it (sharing every block) and all n compute that last token
in the same step, each sampling its own first token with its own seq_index. The shared,
partially filled last block is copied on write for each child (`copies`, children first, so
the parent keeps its block). A one-token prompt has nothing to share: its n sequences start
independent.

Invariant: a fork is all or nothing. Either every child exists, shares the parent's blocks and
is scheduled with the parent in the same step, or nothing changed (no block was taken, no
child made); the blocks it needs are counted, and made room for, before the first child.
"""

from __future__ import annotations

import itertools

from kvcache import KVCacheManager
from scheduler.preemption import Preemptor
from scheduler.queues import RequestQueues
from scheduler.request import Request, Seq, SequenceStatus
from scheduler.step_builder import StepBuilder

_RUNNING = SequenceStatus.RUNNING


class Forker:
    """Forks the n - 1 children of a request whose parent has computed its prompt but for the
    last token, with the scheduler's sequence ids (`seq_ids`, the scheduler's counter)."""

    def __init__(self, kv: KVCacheManager, queues: RequestQueues, preemptor: Preemptor,
                 seq_ids: itertools.count) -> None:
        self.kv = kv
        self.queues = queues
        self.preemptor = preemptor
        self.seq_ids = seq_ids

    def schedule(self, req: Request, step: StepBuilder, may_preempt: bool) -> None:
        """Fork the n - 1 children from the parent (whose prompt is computed but for its last
        token) and schedule that token for all n sequences, all or nothing."""
        n = req.n
        if step.budget < n or step.seq_slots < n:
            return
        kv = self.kv
        parent = req.seqs[0]
        # Children copy the parent's partial last block on write; a full one means a new block each.
        need = n - 1 + kv.num_blocks_needed(parent.seq_id, 1)
        while kv.num_free_gpu_blocks < need:
            if not (may_preempt and self.preemptor.make_room(req, step)):
                if may_preempt and len(self.queues.running) > 1:
                    self.preemptor.preempt(req, step)
                return
        children = []
        for i in range(1, n):
            child = Seq(next(self.seq_ids), i, list(parent.token_ids), parent.prompt_len,
                        _RUNNING)
            child.num_computed = parent.num_computed
            child.max_len = parent.max_len
            kv.fork(parent.seq_id, child.seq_id)
            children.append(child)
        req.seqs += children
        self.queues.add_seqs(req, children)
        req.forked = True
        start = parent.num_computed
        allocs = {}
        for seq in children + [parent]:  # children first: the parent keeps its block
            alloc = kv.allocate_slots(seq.seq_id, seq.token_ids, 1)
            if alloc is None:
                raise RuntimeError(f"KV cache refused the fork of request {req.request_id!r} "
                                   f"after reporting {need} blocks needed and "
                                   f"{kv.num_free_gpu_blocks} free")
            allocs[seq.seq_id] = alloc
        for seq in req.seqs:
            step.add(req, seq, allocs[seq.seq_id], start, 1, kv)
