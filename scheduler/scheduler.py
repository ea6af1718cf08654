"""Continuous batching with chunked prefill, preemption by swap or recompute, and the StepPlan.

One step, `schedule()`, decides in this order (each stage gets what the budget of
`max_num_batched_tokens` tokens and `max_num_seqs` sequences has left):
  1. decodes of running sequences (one token each), in admission order;
  2. prefill chunks of running sequences (partially prefilled, or recomputing after a
     preemption), in admission order;
  3. swapped requests, swapped back in FCFS (nothing in 3-4 runs in a step that preempted);
  4. waiting requests, FCFS (only when nothing is left swapped); the head blocks the rest.
The plan's batch lists every one-token entry that samples (a decode) first, then the chunks.
Stage 1 runs in bulk for the sequences that decoded in the last plan (the decode lane, see
_schedule_decodes), when the KV cache surely has the blocks the stage needs: their rows come
first in the batch, in the order they joined the lane; otherwise, one by one in admission order.

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

Protocol with the workers (scheduler/plan.py): plans execute in the order `schedule()`
returns them and are passed to `apply_result()` in that order. At most two are in flight:
with async scheduling the engine schedules step N+1 while step N runs, so N+1 is ready the
moment N ends. A sequence whose token step N samples then decodes that token in N+1 as a
`PENDING_TOKEN` (the workers have it; the scheduler does not yet): its slot is reserved
ahead, and the block that slot fills is hashed once the token is known. A sequence whose
pending token would end it by length is left out of N+1; one that the token ends by a stop
has computed one token in vain, and its result in N+1 is dropped. Preemption may pick a
sequence with a token in flight: the token still lands and counts (swap keeps the KV it
was computed from; recompute computes it again), so streams equal the synchronous ones.
Every plan that runs after another runs after it on the workers too, so blocks freed while
a plan is in flight can be handed out by the next plan: their old owner's writes come first.
Slots are reserved, and num_computed advanced, when a chunk is scheduled; the KV cache enters
full blocks into the prefix cache at that point, so a request admitted later in the same step
may hit blocks this step computes (workers write the whole batch's KV before attending).

Scheduler is this file plus two mixins: seq_scheduling.py (one sequence's chunk, the fork,
preemption) and results.py (`apply_result()` and finishing sequences); decode_lane.py holds
the decode lane's arrays.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from collections.abc import Sequence as SequenceABC
from operator import itemgetter
from typing import Any

import numpy as np

from kvcache import KVCacheManager, prompt_block_hashes
from scheduler.config import SchedulerConfig
from scheduler.decode_lane import DecodeLane
from scheduler.detokenizer import DetokenizerFactory, IncrementalDetokenizer, StopStringBuffer
from scheduler.outputs import CompletionOutput, RequestOutput, SchedulerStats
from scheduler.plan import PENDING_TOKEN, StepPlan
from scheduler.request import Request, Sequence, SequenceStatus
from scheduler.results import ResultsMixin
from scheduler.sampling_params import SamplingParams
from scheduler.seq_scheduling import SeqSchedulingMixin
from scheduler.step_builder import StepBuilder

_RUNNING = SequenceStatus.RUNNING
_last = itemgetter(-1)
# The decode lane runs while at least this many requests run: below, its fixed cost (some
# twenty numpy calls per step, ~25 us on a small CPU) outweighs what it saves over one by
# one. bench/scheduler_bench.py --against the code without it, context 1024, us per step:
# 48 sequences 135 vs 117, 96 sequences 261 vs 326, 256 sequences 599 vs 735.
LANE_MIN_RUNNING = 64
# The step being executed and the one scheduled ahead of its result (async scheduling).
MAX_PLANS_IN_FLIGHT = 2


class Scheduler(SeqSchedulingMixin, ResultsMixin):
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
        self._inflight: deque[int] = deque()  # step ids of plans awaiting apply_result
        self._pending_drops: list[int] = []  # seq ids to drop in the next plan
        self._deferred: list[RequestOutput] = []  # outputs decided in schedule()
        self._running_dirty = False  # some running request finished in apply_result
        self._lane = DecodeLane()
        # step id -> the lane rows that plan starts with, for apply_result: (requests,
        # sequences, positions, max lengths, output kinds, the lane's departures count then,
        # or -1 when they have left it)
        self._lane_plans: dict[int, tuple[list[Request], list[Sequence], np.ndarray,
                                          np.ndarray, np.ndarray, int]] = {}
        # every stop token id (EOS included) of any request so far, as an array
        self._stop_ids: set[int] = set()
        self._stop_id_array = np.zeros(0, dtype=np.int64)
        # (with blocks of 1 token every decode opens a block: no lane)
        self._lane_min_running = LANE_MIN_RUNNING if kv.block_size > 1 else sys.maxsize
        self._lane_joining = False  # whether sequences join the lane in this step
        self._lane_steps = self._lane_steps_cut = 0  # (for tests: bulk steps, cut short)
        self._text_todo = []  # text owed by apply_result(defer_text=True), see finish_text
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
        if not self._stop_ids.issuperset(req.stop_token_ids):
            self._stop_ids.update(req.stop_token_ids)
            self._stop_id_array = np.array(sorted(self._stop_ids), dtype=np.int64)
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
        req.deferrable = self.tokenizer is not None and sp.logprobs is None and not sp.stop
        self.requests[request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request in any state now, freeing its blocks; None for an unknown id."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._lane.evict(req)
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

    def reset_for_recompute(self) -> None:
        """The workers lost their state (a rank died; the engine rebuilt the group with empty
        caches): every unfinished request goes back to waiting, at the front in admission
        order, to recompute its prompt plus the tokens it has; the KV cache is emptied and
        the plans in flight are forgotten (their tokens never arrived: they are sampled
        again, and a seeded stream draws the same ones). Outputs already decided are kept."""
        back = [r for r in self.running if r.status is _RUNNING]
        back += list(self.swapped)
        back += [r for r in self.waiting if r.status is SequenceStatus.PREEMPTED]
        fresh = [r for r in self.waiting if r.status is not SequenceStatus.PREEMPTED]
        self.kv.reset()
        for req in back:
            for seq in req.live_seqs():
                seq.num_computed = 0
                seq.on_worker = False
            if req.status is not SequenceStatus.PREEMPTED:
                req.move(SequenceStatus.PREEMPTED)
        self.running, self.swapped = [], deque()
        self.waiting = deque(back + fresh)
        self._running_dirty = False
        self._lane.clear()
        self._lane_plans.clear()
        self._inflight.clear()
        self._pending_drops = []

    # ---- schedule ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Decide the next step (see the module docstring) and return its plan."""
        if len(self._inflight) >= MAX_PLANS_IN_FLIGHT:
            raise RuntimeError(f"schedule() called with steps {list(self._inflight)} in flight; "
                               f"at most {MAX_PLANS_IN_FLIGHT} plans may await apply_result()")
        if self._running_dirty:
            self.running = [r for r in self.running if r.status is _RUNNING]
            self._running_dirty = False
        self._step_id += 1
        cfg = self.config
        step = StepBuilder(self._step_id, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                     self._pending_drops)
        self._pending_drops = []

        # 1. Decodes (and n > 1 forks: every sequence computes one token).
        prefill_reqs = self._schedule_decodes(step)

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

        self._inflight.append(step.step_id)
        return step.to_plan()

    def _schedule_decodes(self, step: StepBuilder) -> list[Request]:
        """Stage 1: a token for every running sequence that decodes (and the n > 1 forks due).
        Returns the running requests with prefill chunks left, for stage 2.

        This runs for every running sequence on every step, so once LANE_MIN_RUNNING requests
        run the common case goes in bulk. The decode lane (scheduler/decode_lane.py) holds the
        sequences that decoded a token in the last plan. When stage 1 surely gets every KV
        block it asks for, they all decode again at once (one KVCacheManager.append_slots
        call, arrays straight into the plan) and the requests outside the lane follow one by
        one. Otherwise the lane is emptied and every request goes one by one in admission
        order, as the policy states. Both ways schedule the same sequences at the same
        positions; only the batch order differs (the lane's rows first), and order matters
        only when blocks run short (who may preempt whom), which is when the one-by-one way
        is taken. Sequences that decode plainly one by one join the lane.
        """
        running = self.running
        prefill_reqs: list[Request] = []
        lane = self._lane
        lane.settle()
        self._lane_joining = len(running) >= self._lane_min_running
        if lane.reqs and not self._lane_joining:
            lane.clear()  # too few running for the lane to pay
        if lane.reqs:
            # Every member decoded in the last plan: with that plan in flight (async
            # scheduling) each input is the token it samples, else the last known token.
            ahead = bool(self._inflight)
            if ahead:
                edge = np.flatnonzero(lane.pos + 1 >= lane.max_len)
                if edge.size:  # their tokens in flight end them by length: not computed ahead
                    lane.evict_rows(edge.tolist())
            outside = [r for r in running if not r.in_lane] if len(running) > len(lane) else []
            if lane.reqs and self._lane_fits(outside):
                self._decode_lane(step, ahead)
                self._decode_one_by_one(outside, step, prefill_reqs)
                return prefill_reqs
            lane.clear()
        self._decode_one_by_one(list(running), step, prefill_reqs)
        return prefill_reqs

    def _lane_fits(self, outside: list[Request]) -> bool:
        """Whether stage 1 surely gets every KV block it asks for: the lane's new blocks, and
        at most two per live sequence of the requests outside it (a fork: n + 1)."""
        need = int(np.count_nonzero(self._lane.pos % self.block_size == 0))
        for req in outside:
            need += 2 * len(req.seqs) if req.forked else req.n + 1
        return need <= self.kv.num_free_gpu_blocks

    def _decode_lane(self, step: StepBuilder, ahead: bool) -> None:
        lane = self._lane
        n = len(lane)
        self._lane_steps += 1
        done = 0
        allocate = self.kv.allocate_slots
        appended = step.appended
        for sid, tokens in zip(lane.seq_ids, lane.token_lists):
            alloc = allocate(sid, tokens, 1, num_pending=int(ahead))
            if alloc is None or alloc.copies:
                break
            if alloc.new_block_ids:
                appended[sid] = alloc.new_block_ids
            done += 1
        if ahead:
            inputs = np.full(done, PENDING_TOKEN, dtype=np.int64)
        else:
            inputs = np.fromiter(map(_last, lane.token_lists[:done]), np.int64, done)
        reqs, seqs, pos = lane.reqs[:done], lane.seqs[:done], lane.pos[:done].copy()
        step.lane = (lane.ids[:done], pos, inputs)
        # (max_len and kind are never changed in place: their slices stay as they are now)
        self._lane_plans[step.step_id] = (reqs, seqs, pos, lane.max_len[:done],
                                          lane.kind[:done], lane.departures if done == n else -1)
        rest: list[Request] = []
        if done < n:  # (not expected: _lane_fits) the rest one by one, the lane emptied
            self._lane_steps_cut += 1
            rest = lane.reqs[done:]
            lane.clear()
        else:
            lane.pos += 1
        for seq in seqs:
            seq.num_computed += 1
        step_id = step.step_id
        for req in reqs:
            req.scheduled_step = step_id
        step.budget -= done
        step.seq_slots -= done
        self._decode_one_by_one(rest, step, [])

    def _decode_one_by_one(self, reqs: list[Request], step: StepBuilder,
                           prefill_reqs: list[Request]) -> None:
        """Stage 1 for these running requests, in order, one sequence at a time (appending
        to prefill_reqs those with prefill chunks left). The common case, a sequence the
        workers hold that gets its slot without preemption or copy-on-write, is inlined and
        joins the decode lane; its entries are counted in `taken` and charged to the step's
        budget and sequence slots in one go, before any slow path (which charges its own)."""
        allocate = self.kv.allocate_slots
        appended = step.appended
        dec_ids, dec_pos, dec_tokens = step.dec_ids, step.dec_pos, step.dec_tokens
        step_id = step.step_id
        join = self._lane.join if self._lane_joining else None
        cap = min(step.budget, step.seq_slots)
        taken = 0
        full = False
        for req in reqs:
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
                num_known = len(tokens)
                if num_known - start == 1 and start:
                    ahead = 0
                elif num_known == start:
                    # Its last token is being sampled by the step in flight: compute it next,
                    # unless that token ends the sequence by length.
                    if start + 1 >= seq.max_len:
                        continue
                    ahead = 1
                else:
                    if start < num_known:
                        has_prefill = True
                    continue  # else two plans in flight already compute its tokens
                if taken == cap:
                    full = True
                    break
                sid = seq.seq_id
                alloc = allocate(sid, tokens, 1, num_pending=ahead)
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
                dec_tokens.append(PENDING_TOKEN if ahead else tokens[start])
                taken += 1
                if join is not None and req.n == 1:
                    join(req, seq)
            if has_prefill:
                prefill_reqs.append(req)
        step.budget -= taken
        step.seq_slots -= taken

    # ---- helpers ----------------------------------------------------------------------------

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

    def check_lane(self) -> None:
        """Assert the decode lane mirrors the sequences' state (for tests, between calls)."""
        self._lane.check(self.running, self.kv.num_slots)

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
