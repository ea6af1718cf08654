"""Continuous batching with chunked prefill, preemption by swap or recompute, and the StepPlan.

One step, `schedule()`, decides in this order (each stage gets what the budget of
`max_num_batched_tokens` tokens and `max_num_seqs` sequences has left):
  1. decodes of running sequences (one token each), in admission order;
  2. prefill chunks of running sequences (partially prefilled, or recomputing after a
     preemption), in admission order;
  3. swapped requests, swapped back in FCFS (nothing in 3-4 runs in a step that preempted);
  4. waiting requests, FCFS (only when nothing is left swapped); the head blocks the rest.
The plan's batch lists every one-token entry that samples (a decode) first, then the chunks.

When a running sequence cannot get a KV block, the most recently admitted running request not
yet scheduled in this step is preempted, all its sequences together: swapped to CPU when the
mode is "swap" and the CPU pool holds it, else freed and reset for recompute. With nobody left
to preempt the request preempts itself, or, when it is the only running request, the sequence
that cannot grow finishes with "length": the cache itself is its length limit. Requests are
never preempted to admit new ones.

n > 1 (parallel sampling): the parent sequence prefills the prompt except its last token; then
the n - 1 children are forked from it (sharing every block) and all n compute that last token
in the same step, each sampling its own first token with its own seq_index. The shared,
partially filled last block is copied on write for each child (`copies`, children first, so
the parent keeps its block). A one-token prompt has nothing to share: its n sequences start
independent.

Protocol with the workers (scheduler/plan.py): one plan in flight; every plan returned by
`schedule()` must be executed and passed to `apply_result()` before the next `schedule()`.
Slots are reserved, and num_computed advanced, when a chunk is scheduled; the KV cache enters
full blocks into the prefix cache at that point, so a request admitted later in the same step
may hit blocks this step computes (workers write the whole batch's KV before attending).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence as SequenceABC
from typing import Any

import numpy as np

from kvcache import Allocation, KVCacheManager, prompt_block_hashes
from scheduler.config import SchedulerConfig
from scheduler.detokenizer import DetokenizerFactory, IncrementalDetokenizer, StopStringBuffer
from scheduler.output_processor import flush_text, process_token
from scheduler.outputs import CompletionOutput, RequestOutput, SchedulerStats
from scheduler.plan import NewSeq, StepPlan, StepResult
from scheduler.request import Request, Sequence, SequenceStatus
from scheduler.sampling_params import SamplingParams
from scheduler.step_builder import StepBuilder

_RUNNING = SequenceStatus.RUNNING
_FINISHED_LENGTH = SequenceStatus.FINISHED_LENGTH


class Scheduler:
    """Requests in, StepPlans out, RequestOutput deltas back.

    Invariants between calls: `running` holds RUNNING requests in (re)admission order (the
    victim end is the tail), `waiting` WAITING and PREEMPTED requests (recompute victims at the
    front), `swapped` SWAPPED ones; every unfinished request is in `requests` and in exactly
    one queue; a running request's live sequences number at most `max_num_seqs` in all.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, tokenizer: Any = None,
                 eos_token_ids: SequenceABC[int] = (),
                 detokenizer_factory: DetokenizerFactory | None = None) -> None:
        """`detokenizer_factory(prompt_token_ids, skip_special_tokens)` makes each sequence's
        detokenizer (the engine passes a Rust-backed one); by default IncrementalDetokenizer
        over `tokenizer`, which only needs the tokenizer's Python API."""
        mode = config.preemption_mode or ("swap" if kv.num_cpu_blocks > 0 else "recompute")
        if mode == "swap" and kv.num_cpu_blocks == 0:
            raise ValueError("preemption_mode='swap' needs CPU swap blocks (num_cpu_blocks > 0); "
                             "give the cache swap space or use preemption_mode='recompute'")
        self.config = config
        self.kv = kv
        self.tokenizer = tokenizer
        self.detokenizer_factory = detokenizer_factory
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.preemption_mode = mode
        self.block_size = kv.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._seqs: dict[int, tuple[Request, Sequence]] = {}
        self._seq_ids = itertools.count()
        self._step_id = 0
        self._inflight: int | None = None  # step_id of the plan awaiting apply_result
        self._pending_drops: list[int] = []  # seq ids to drop in the next plan
        self._deferred: list[RequestOutput] = []  # outputs decided in schedule()
        self._running_dirty = False  # some running request finished in apply_result
        # token id -> convert_ids_to_tokens result, per skip_special_tokens, for every
        # detokenizer of this scheduler's tokenizer
        self._token_cache: dict[bool, dict[int, list[str]]] = {True: {}, False: {}}
        self.preemptions_swap = 0
        self.preemptions_recompute = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, arrival_time: float | None = None,
                    cache_salt: str | None = None) -> None:
        """Queue a request; raise ValueError if it is malformed or could never be scheduled."""
        sp = sampling_params
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use; pick a unique id")
        prompt = list(map(int, prompt_token_ids))
        num_prompt = len(prompt)
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty; "
                             "a request needs at least one prompt token")
        vocab = len(self.tokenizer) if self.tokenizer is not None else None
        if min(prompt) < 0 or (vocab is not None and max(prompt) >= vocab):
            raise ValueError(f"request {request_id!r}: prompt token ids must be in "
                             f"[0, {vocab if vocab is not None else 'vocab size'}); got "
                             f"min {min(prompt)}, max {max(prompt)}")
        max_len = self.config.max_model_len
        if num_prompt >= max_len:
            raise ValueError(f"request {request_id!r}: prompt has {num_prompt} tokens; "
                             f"max_model_len is {max_len} (the prompt must be shorter to leave "
                             "room for output)")
        if sp.n > self.config.max_num_seqs:
            raise ValueError(f"request {request_id!r}: n={sp.n} exceeds max_num_seqs="
                             f"{self.config.max_num_seqs}")
        need = self._min_blocks(num_prompt, sp.n)
        if need > self.kv.num_gpu_blocks:
            raise ValueError(
                f"request {request_id!r}: a prompt of {num_prompt} tokens with n={sp.n} needs "
                f"{need} KV blocks of {self.block_size} tokens, but the GPU cache has only "
                f"{self.kv.num_gpu_blocks}; shorten the prompt, lower n, or give the cache more "
                "memory")
        if sp.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need a tokenizer; this "
                             "scheduler has none (use stop_token_ids)")
        parent = Sequence(next(self._seq_ids), 0, list(prompt), num_prompt, SequenceStatus.WAITING)
        req = Request(request_id, prompt, sp,
                      time.monotonic() if arrival_time is None else arrival_time,
                      cache_salt.encode() if cache_salt else None, parent,
                      self.eos_token_ids, max_len)
        if self.kv.enable_prefix_caching:
            req.block_hashes = prompt_block_hashes(prompt, self.block_size, req.extra_key)
        if sp.n > 1 and num_prompt == 1:
            # Nothing to share before the first (and only) prompt token: start n independent
            # sequences.
            for i in range(1, sp.n):
                req.seqs.append(Sequence(next(self._seq_ids), i, list(prompt), 1,
                                         SequenceStatus.WAITING))
            req.forked = True
        for seq in req.seqs:
            self._init_seq(req, seq)
            self._seqs[seq.seq_id] = (req, seq)
        req.plain = self.tokenizer is None and sp.logprobs is None
        self.requests[request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request in any state now, freeing its blocks; None for an unknown id."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        status = req.status
        if status is _RUNNING:
            self.running.remove(req)
        elif status is SequenceStatus.SWAPPED:
            self.swapped.remove(req)
        else:
            self.waiting.remove(req)
        want_lp = req.sampling_params.logprobs is not None
        outputs = []
        for seq in req.seqs:
            self._seqs.pop(seq.seq_id, None)
            if seq.status.is_finished:
                continue
            self._release(seq, self._pending_drops)
            outputs.append(CompletionOutput(seq.index, [], "", "abort", None,
                                            [] if want_lp else None))
        req.move(SequenceStatus.FINISHED_ABORTED)
        return RequestOutput(req.request_id, req.prompt_token_ids, outputs, True,
                             req.num_cached_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- schedule ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Decide the next step (see the module docstring) and return its plan."""
        if self._inflight is not None:
            raise RuntimeError(f"schedule() called before apply_result() of step {self._inflight}; "
                               "every plan must be applied before the next one")
        if self._running_dirty:
            self.running = [r for r in self.running if r.status is _RUNNING]
            self._running_dirty = False
        self._step_id += 1
        cfg = self.config
        step = StepBuilder(self._step_id, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                     self._pending_drops)
        self._pending_drops = []

        # 1. Decodes (and n > 1 forks: every sequence computes one token). The common case,
        # a sequence the workers hold that gets its slot without preemption or copy-on-write,
        # is inlined: this loop runs for every running sequence on every step. Its entries are
        # counted in `taken` and charged to the step's budget and sequence slots in one go,
        # before any slow path (which reads and charges them itself).
        append_slot = self.kv.append_slot
        appended = step.appended
        dec_ids, dec_pos, dec_tokens = step.dec_ids, step.dec_pos, step.dec_tokens
        step_id = step.step_id
        prefill_reqs: list[Request] = []
        cap = min(step.budget, step.seq_slots)
        taken = 0
        full = False
        for req in list(self.running):
            if full:
                break
            if req.status is not _RUNNING:
                continue
            if not req.forked:
                parent = req.seqs[0]
                if parent.num_computed == parent.prompt_len - 1:
                    step.budget -= taken
                    step.seq_slots -= taken
                    taken = 0
                    self._schedule_fork(req, step, may_preempt=True)
                    cap = min(step.budget, step.seq_slots)
                else:
                    prefill_reqs.append(req)
                continue
            has_prefill = False
            for seq in req.seqs:
                if seq.status is not _RUNNING:
                    continue
                tokens = seq.token_ids
                start = seq.num_computed
                if not start or len(tokens) - start != 1:
                    has_prefill = True
                    continue
                if taken == cap:
                    full = True
                    break
                sid = seq.seq_id
                alloc = append_slot(sid, tokens)
                if alloc is None or alloc.copies or not seq.on_worker:
                    step.budget -= taken
                    step.seq_slots -= taken
                    taken = 0
                    if alloc is None:
                        scheduled = self._schedule_seq(req, seq, step, may_preempt=True)
                    else:
                        self._record(req, seq, step, alloc, start, 1)
                        scheduled = 1
                    cap = min(step.budget, step.seq_slots)
                    if scheduled < 0:
                        break  # the request itself was preempted
                    continue
                seq.num_computed = start + 1
                req.scheduled_step = step_id
                new_ids = alloc.new_block_ids
                if new_ids:
                    appended[sid] = new_ids
                dec_ids.append(sid)
                dec_pos.append(start)
                dec_tokens.append(tokens[start])
                taken += 1
            if has_prefill:
                prefill_reqs.append(req)
        step.budget -= taken
        step.seq_slots -= taken

        # 2. Prefill chunks of running requests.
        for req in prefill_reqs:
            if step.budget == 0 or step.seq_slots == 0:
                break
            if req.status is not _RUNNING:
                continue
            for seq in req.seqs:
                if seq.status is _RUNNING and req.target_len(seq) > seq.num_computed:
                    if step.budget == 0 or step.seq_slots == 0:
                        break
                    if self._schedule_seq(req, seq, step, may_preempt=True) < 0:
                        break

        if not step.preempted and (self.swapped or self.waiting):
            num_seqs = sum(self._reserved_seqs(r) for r in self.running)
            # 3. Swapped requests come back before any new one is admitted.
            while self.swapped and step.budget and step.seq_slots:
                req = self.swapped[0]
                if num_seqs + self._reserved_seqs(req) > cfg.max_num_seqs:
                    break
                ids = [s.seq_id for s in req.live_seqs() if self.kv.has_seq(s.seq_id)]
                if not self.kv.can_swap_in(ids):
                    if self.running:
                        break
                    # Alone on an idle GPU and still over the watermark: recompute it instead.
                    self.swapped.popleft()
                    self._reset_for_recompute(req)
                    self.waiting.appendleft(req)
                    continue
                self.swapped.popleft()
                step.swap_in.extend(self.kv.swap_in(ids))
                req.move(_RUNNING)
                self.running.append(req)
                num_seqs += self._reserved_seqs(req)
                self._schedule_request(req, step, admit=False)
            # 4. Waiting requests, FCFS.
            while not self.swapped and self.waiting and step.budget and step.seq_slots:
                req = self.waiting[0]
                if num_seqs + self._reserved_seqs(req) > cfg.max_num_seqs:
                    break
                # The watermark keeps headroom for running requests to grow; alone, use it all.
                admit = bool(self.running)
                live = req.live_seqs()
                if self._schedule_seq(req, live[0], step, admit=admit) <= 0:
                    break
                self.waiting.popleft()
                req.move(_RUNNING)
                self.running.append(req)
                num_seqs += self._reserved_seqs(req)
                if not req.admitted:
                    req.admitted = True
                    self.prompt_tokens_total += len(req.prompt_token_ids)
                for seq in live[1:]:
                    if step.budget == 0 or step.seq_slots == 0:
                        break
                    self._schedule_seq(req, seq, step, admit=admit)

        self._inflight = step.step_id
        return step.to_plan()

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
            to_compute = (len(seq.token_ids) if req.forked else seq.prompt_len - 1) - computed
            chunk = min(to_compute, step.budget)
            if chunk <= 0 or (chunk < to_compute and not self.config.enable_chunked_prefill):
                return 0
            alloc = kv.allocate_slots(seq.seq_id, seq.token_ids, chunk, prefix, req.extra_key,
                                      admit, req.block_hashes)
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
        if chunk == 1 and end == len(tokens):
            step.dec_ids.append(sid)
            step.dec_pos.append(start)
            step.dec_tokens.append(tokens[start])
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

    # ---- results ----------------------------------------------------------------------------

    def apply_result(self, plan: StepPlan, result: StepResult | None) -> list[RequestOutput]:
        """Append the sampled tokens, check stop conditions, and return output deltas.

        `result` may be None for a plan in which no sequence samples. Tokens of sequences
        aborted while the step ran are ignored.
        """
        if self._inflight != plan.step_id:
            raise RuntimeError(f"apply_result() for step {plan.step_id}, but the plan awaiting "
                               f"results is {self._inflight}")
        outputs, self._deferred = self._deferred, []
        if result is None:
            if plan.do_sample.any():
                raise ValueError(f"step {plan.step_id} samples {np.count_nonzero(plan.do_sample)} "
                                 "sequences but no StepResult was given")
            self._inflight = None
            return outputs
        num_sampled = int(np.count_nonzero(plan.do_sample))
        if result.step_id != plan.step_id or result.seq_ids.shape[0] != num_sampled:
            raise ValueError(f"StepResult of step {result.step_id} with {result.seq_ids.shape[0]} "
                             f"tokens does not answer plan {plan.step_id} "
                             f"({num_sampled} sequences sample)")
        self._inflight = None
        touched: dict[str, tuple[Request, RequestOutput]] = {}
        seqs_get = self._seqs.get
        emit = outputs.append
        new_obj = object.__new__
        num_tokens = 0
        for row, (sid, token) in enumerate(zip(result.seq_ids.tolist(),
                                               result.token_ids.tolist())):
            entry = seqs_get(sid)
            if entry is None:
                continue  # aborted while the step ran
            req, seq = entry
            tokens = seq.token_ids
            tokens.append(token)
            num_tokens += 1
            if req.plain and token not in req.stop_token_ids and len(tokens) < seq.max_len:
                # No text, no logprobs, no stop: the delta is just the token. Built field by
                # field: the dataclass __init__ call costs more than the rest of this loop.
                comp = new_obj(CompletionOutput)
                comp.index = seq.index
                comp.token_ids = [token]
                comp.text = ""
                comp.finish_reason = comp.stop_reason = comp.logprobs = None
                if req.n == 1:
                    out = new_obj(RequestOutput)
                    out.request_id = req.request_id
                    out.prompt_token_ids = req.prompt_token_ids
                    out.outputs = [comp]
                    out.finished = False
                    out.num_cached_tokens = req.num_cached_tokens
                    emit(out)
                    continue
            else:
                comp = self._token_output(req, seq, token, result, row)
                if req.n == 1:
                    out = RequestOutput(req.request_id, req.prompt_token_ids, [comp],
                                        comp.finish_reason is not None, req.num_cached_tokens)
                    emit(out)
                    if out.finished:
                        self._running_dirty = True
                        self._forget(req)
                    continue
            hit = touched.get(req.request_id)
            if hit is None:
                out = RequestOutput(req.request_id, req.prompt_token_ids, [comp], False,
                                    req.num_cached_tokens)
                touched[req.request_id] = (req, out)
                emit(out)
            else:
                hit[1].outputs.append(comp)
        self.generation_tokens_total += num_tokens
        for req, out in touched.values():
            if req.is_finished:
                out.finished = True
                self._running_dirty = True
                self._forget(req)
        return outputs

    def _token_output(self, req: Request, seq: Sequence, token: int, result: StepResult,
                      row: int) -> CompletionOutput:
        """The output delta of a token just appended: stop checks, text, logprobs."""
        status, text, stop_reason, logprobs = process_token(req, seq, token, result, row)
        if status is None:
            return CompletionOutput(seq.index, [token], text, None, None, logprobs)
        self._release(seq, self._pending_drops)
        return self._finish_output(req, seq, status, [token], text, stop_reason, logprobs)

    def _finish_output(self, req: Request, seq: Sequence, status: SequenceStatus,
                       token_ids: list[int], text: str, stop_reason: str | int | None,
                       logprobs: list[dict[int, float]] | None) -> CompletionOutput:
        """Finish a sequence whose blocks are released; its held-back text goes out unless a
        stop string ended it (then the rest is cut off)."""
        if not isinstance(stop_reason, str):
            text += flush_text(seq)
        seq.stop_reason = stop_reason
        req.finish_seq(seq, status)
        if logprobs is None and req.sampling_params.logprobs is not None:
            logprobs = []
        return CompletionOutput(seq.index, token_ids, text, status.finish_reason, stop_reason,
                                logprobs)

    # ---- helpers ----------------------------------------------------------------------------

    def _release(self, seq: Sequence, drops: list[int]) -> None:
        """Free the sequence's blocks and have the workers drop its state."""
        self.kv.free(seq.seq_id)
        if seq.on_worker:
            drops.append(seq.seq_id)
            seq.on_worker = False

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        for seq in req.seqs:
            self._seqs.pop(seq.seq_id, None)

    def _init_seq(self, req: Request, seq: Sequence) -> None:
        seq.max_len = seq.prompt_len + req.max_output
        if self.tokenizer is None:
            return
        sp = req.sampling_params
        if self.detokenizer_factory is not None:
            seq.detokenizer = self.detokenizer_factory(req.prompt_token_ids, sp.skip_special_tokens)
        else:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, sp.skip_special_tokens,
                self._token_cache[sp.skip_special_tokens])
        if sp.stop:
            seq.stop_buffer = StopStringBuffer(sp.stop, sp.include_stop_str_in_output)

    def _min_blocks(self, num_prompt: int, n: int) -> int:
        """Blocks a request needs to sample its first tokens: the prompt but its last token,
        then that token once per sequence (in the shared last block, copied per child, or in
        a new block each when the shared part ends on a block boundary)."""
        bs = self.block_size
        shared = num_prompt - 1
        return -(-shared // bs) + (n if shared % bs == 0 else n - 1)

    @staticmethod
    def _reserved_seqs(req: Request) -> int:
        """Sequences the request occupies against max_num_seqs (n until it has forked)."""
        if not req.forked:
            return req.n
        return sum(1 for s in req.seqs if not s.status.is_finished)

    # ---- metrics ----------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        kv = self.kv.stats()
        running = [r for r in self.running if r.status is _RUNNING]
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(running),
            num_swapped=len(self.swapped),
            num_running_seqs=sum(self._reserved_seqs(r) for r in running),
            preemptions_swap=self.preemptions_swap,
            preemptions_recompute=self.preemptions_recompute,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_steps=self._step_id,
            num_gpu_blocks=kv.num_gpu_blocks,
            num_free_gpu_blocks=kv.num_free_gpu_blocks,
            num_cpu_blocks=kv.num_cpu_blocks,
            num_free_cpu_blocks=kv.num_free_cpu_blocks,
            gpu_usage=kv.gpu_usage,
            cpu_usage=kv.cpu_usage,
            prefix_queries=kv.prefix_queries,
            prefix_hits=kv.prefix_hits,
            evictions=kv.evictions,
        )
