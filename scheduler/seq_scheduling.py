"""One sequence's next chunk: its KV slots, the n > 1 fork, its entry in the step, and
preemption when the cache cannot grow (the policy is in scheduler/scheduler.py's docstring).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvcache import Allocation, KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.decode_lane import DecodeLane
from scheduler.outputs import RequestOutput
from scheduler.plan import PENDING_TOKEN, NewSeq
from scheduler.request import Request, Sequence, SequenceStatus
from scheduler.step_builder import StepBuilder

_RUNNING = SequenceStatus.RUNNING
_FINISHED_LENGTH = SequenceStatus.FINISHED_LENGTH


class SeqSchedulingMixin:
    """Scheduler's per-sequence scheduling: `schedule()` calls these for everything but the
    plain decode it inlines. Mixed into Scheduler, whose state it shares (declared below);
    finishing a sequence goes through ResultsMixin (`_release`, `_forget`, `_finish_output`).
    """

    config: SchedulerConfig
    kv: KVCacheManager
    block_size: int
    preemption_mode: str
    running: list[Request]
    waiting: deque[Request]
    swapped: deque[Request]
    _seqs: dict[int, tuple[Request, Sequence]]
    _seq_ids: Iterator[int]
    _lane: DecodeLane
    _deferred: list[RequestOutput]
    preemptions_swap: int
    preemptions_recompute: int

    def _schedule_request(self, req: Request, step: StepBuilder, admit: bool) -> None:
        """Schedule every live sequence of a just-resumed request, preempting nobody."""
        if not req.forked:
            parent = req.seqs[0]
            if parent.num_computed == parent.prompt_len - 1:
                self._schedule_fork(req, step, may_preempt=False)
                return
        for seq in req.seqs:
            if seq.status is _RUNNING and req.target_len(seq) > seq.num_computed:
                if step.budget == 0 or step.seq_slots == 0:
                    return
                self._schedule_seq(req, seq, step, admit=admit)

    def _schedule_seq(self, req: Request, seq: Sequence, step: StepBuilder, admit: bool = False,
                      may_preempt: bool = False) -> int:
        """Reserve slots for the sequence's next chunk and add it to the step.

        Returns the tokens scheduled (> 0), 0 when nothing was scheduled, or -1 when the
        request had to preempt itself.
        """
        kv = self.kv
        bs = self.block_size
        while True:
            computed = seq.num_computed
            prefix: list[int] = []
            if computed == 0 and not kv.has_seq(seq.seq_id):
                prefix = kv.lookup_prefix(seq.token_ids, req.extra_key, req.block_hashes)
                if not req.forked and len(prefix) * bs >= seq.prompt_len - 1:
                    prefix = prefix[:-1]  # an unforked parent computes >= 1 token before forking
                computed = len(prefix) * bs
            target = req.target_len(seq)
            # A decode of the token the step in flight samples (see Scheduler): one ahead.
            # (schedule() leaves out one whose pending token ends it by length.)
            ahead = int(computed == target and computed > 0 and req.forked)
            to_compute = target + ahead - computed
            chunk = min(to_compute, step.budget)
            if chunk <= 0 or (chunk < to_compute and not self.config.enable_chunked_prefill):
                return 0
            alloc = kv.allocate_slots(seq.seq_id, seq.token_ids, chunk, prefix, req.extra_key,
                                      admit, req.block_hashes, ahead)
            if alloc is not None:
                break
            if not may_preempt:
                return 0
            victim = self._pick_victim(req, step)
            if victim is not None:
                self._preempt(victim, step)
                continue
            if req.scheduled_step == step.step_id:
                return 0  # some of its sequences already run this step: wait for the next
            if len(self.running) > 1:
                self._preempt(req, step)
                return -1
            if not ahead:  # (else decide once the token in flight has landed)
                self._finish_for_capacity(req, seq, step)
            return 0
        if prefix and not req.admitted:
            req.num_cached_tokens = computed
        self._record(req, seq, step, alloc, computed, chunk)
        return chunk

    def _schedule_fork(self, req: Request, step: StepBuilder, may_preempt: bool) -> None:
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
            victim = self._pick_victim(req, step) if may_preempt else None
            if victim is None:
                if may_preempt and len(self.running) > 1:
                    self._preempt(req, step)
                return
            self._preempt(victim, step)
        for i in range(1, n):
            child = Sequence(next(self._seq_ids), i, list(parent.token_ids), parent.prompt_len,
                             _RUNNING)
            child.num_computed = parent.num_computed
            kv.fork(parent.seq_id, child.seq_id)
            self._init_seq(req, child)
            req.seqs.append(child)
            self._seqs[child.seq_id] = (req, child)
        req.forked = True
        start = parent.num_computed
        allocs: dict[int, Allocation] = {}
        for seq in req.seqs[1:] + [parent]:  # children first: the parent keeps its block
            alloc = kv.allocate_slots(seq.seq_id, seq.token_ids, 1)
            if alloc is None:
                raise RuntimeError(f"KV cache refused the fork of request {req.request_id!r} "
                                   f"after reporting {need} blocks needed and "
                                   f"{kv.num_free_gpu_blocks} free")
            allocs[seq.seq_id] = alloc
        for seq in req.seqs:
            self._record(req, seq, step, allocs[seq.seq_id], start, 1)

    def _record(self, req: Request, seq: Sequence, step: StepBuilder, alloc: Allocation, start: int,
                chunk: int) -> None:
        """Add a scheduled chunk to the step: batch entry, table diff, copy-on-write pairs."""
        sid = seq.seq_id
        seq.num_computed = end = start + chunk
        req.scheduled_step = step.step_id
        if not seq.on_worker:
            step.new_seqs.append(NewSeq(sid, req.request_id, seq.index, seq.prompt_len,
                                        seq.token_ids[:start], list(self.kv.block_table(sid)),
                                        req.sampling_params))
            seq.on_worker = True
        elif alloc.copies:
            step.replaced[sid] = list(self.kv.block_table(sid))
        elif alloc.new_block_ids:
            step.appended[sid] = alloc.new_block_ids
        if alloc.copies:
            step.copies.extend(alloc.copies)
        step.budget -= chunk
        step.seq_slots -= 1
        tokens = seq.token_ids
        if chunk == 1 and end >= len(tokens):  # end > len: its token is in flight
            step.dec_ids.append(sid)
            step.dec_pos.append(start)
            step.dec_tokens.append(tokens[start] if start < len(tokens) else PENDING_TOKEN)
        else:
            step.pre_ids.append(sid)
            step.pre_lens.append(chunk)
            step.pre_pos.append(start)
            step.pre_sample.append(end == len(tokens))
            step.pre_tokens.extend(tokens[start:end])

    # ---- preemption -------------------------------------------------------------------------

    def _pick_victim(self, req: Request, step: StepBuilder) -> Request | None:
        """The most recently admitted running request other than `req` with nothing in this
        step (its blocks hold only KV computed in earlier steps, so freeing them is safe)."""
        for victim in reversed(self.running):
            if victim is not req and victim.scheduled_step != step.step_id:
                return victim
        return None

    def _preempt(self, req: Request, step: StepBuilder) -> None:
        self.running.remove(req)
        self._lane.evict(req)
        step.preempted = True
        live = req.live_seqs()
        for seq in live:
            if seq.on_worker:
                step.dropped.append(seq.seq_id)
                seq.on_worker = False
        ids = [s.seq_id for s in live if self.kv.has_seq(s.seq_id)]
        if self.preemption_mode == "swap" and ids and self.kv.can_swap_out(ids):
            step.swap_out.extend(self.kv.swap_out(ids))
            req.move(SequenceStatus.SWAPPED)
            self.swapped.appendleft(req)
            self.preemptions_swap += 1
        else:
            self._reset_for_recompute(req)
            self.waiting.appendleft(req)
            self.preemptions_recompute += 1

    def _reset_for_recompute(self, req: Request) -> None:
        """Free the request's KV; its prompt + outputs so far become the tokens to compute."""
        for seq in req.live_seqs():
            self.kv.free(seq.seq_id)
            seq.num_computed = 0
        req.move(SequenceStatus.PREEMPTED)

    def _finish_for_capacity(self, req: Request, seq: Sequence, step: StepBuilder) -> None:
        self._release(seq, step.dropped)
        comp = self._finish_output(req, seq, _FINISHED_LENGTH, [], "", None, None)
        finished = req.is_finished
        if finished:
            self.running.remove(req)
            self._forget(req)
        self._deferred.append(RequestOutput(req.request_id, req.prompt_token_ids, [comp],
                                            finished, req.num_cached_tokens))
