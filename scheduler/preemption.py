"""Preemption: who gives up KV blocks when a running sequence cannot grow, and how.

The policy (scheduler/scheduler.py states it whole): the victim is the most recently admitted
running request that has nothing in the step being built (its blocks hold only KV computed in
earlier steps, so freeing them is safe), all its sequences together. It is swapped to CPU
when the mode is "swap" and the CPU pool holds it, else its KV is freed and it is reset to
recompute its prompt and outputs so far. Requests are never preempted to admit new ones.
"""

from __future__ import annotations

from kvcache import KVCacheManager
from scheduler.queues import RequestQueues
from scheduler.request import Request, SequenceStatus
from scheduler.step_builder import StepBuilder


class Preemptor:
    """Owns the preemption mode and counts; `make_room` is the entry point."""

    def __init__(self, mode: str, kv: KVCacheManager, queues: RequestQueues) -> None:
        if mode == "swap" and kv.num_cpu_blocks == 0:
            raise ValueError("preemption_mode='swap' needs CPU swap blocks (num_cpu_blocks > 0); "
                             "give the cache swap space or use preemption_mode='recompute'")
        self.mode = mode
        self.kv = kv
        self.queues = queues
        self.num_swapped = 0
        self.num_recomputed = 0

    def make_room(self, req: Request, step: StepBuilder) -> bool:
        """Preempt the victim for `req` (see the module docstring); False when there is none."""
        for victim in reversed(self.queues.running):
            if victim is not req and victim.scheduled_step != step.step_id:
                self.preempt(victim, step)
                return True
        return False

    def preempt(self, req: Request, step: StepBuilder) -> None:
        """Take a running request off the GPU: swap it out or reset it for recompute."""
        step.preempted = True
        kv = self.kv
        ids = [s.seq_id for s in req.live_seqs() if kv.has_seq(s.seq_id)]
        if self.mode == "swap" and ids and kv.can_swap_out(ids):
            self.queues.leave_running(req, SequenceStatus.SWAPPED)
            step.swap_out.extend(kv.swap_out(ids))
            self.num_swapped += 1
        else:
            self.queues.leave_running(req, SequenceStatus.PREEMPTED)
            self.free_for_recompute(req)
            self.num_recomputed += 1

    def free_for_recompute(self, req: Request) -> None:
        """Free the request's KV: its prompt + outputs so far become the tokens to compute."""
        for seq in req.live_seqs():
            self.kv.free(seq.seq_id)
            seq.num_computed = 0
