"""Continuous batching with chunked prefill, preemption by swap or recompute, and the StepPlan.

One step, `schedule()`, decides in this order (each stage gets what the budget of
`max_num_batched_tokens` tokens and `max_num_seqs` sequences has left; when stage 1 put rows in
the step, stages 2-4 together get at most `max_mixed_prefill_tokens` of it):
  1. decodes of running sequences (one token each), in admission order;
  2. prefill chunks of running sequences (partially prefilled, or recomputing after a
     preemption), in admission order;
  3. swapped requests, swapped back in FCFS (nothing in 3-4 runs in a step that preempted);
  4. waiting requests, FCFS (only when nothing is left swapped); the head blocks the rest.
The plan's batch lists every one-token entry that samples (a decode) first, then the chunks.
Stage 1 goes through the decode lane first when it runs (scheduler/decode_lane.py: its rows
come first in the batch, which is the only difference it makes).

When a running sequence cannot get a KV block, the most recently admitted running request not
yet scheduled in this step is preempted (scheduler/preemption.py). With nobody left to
preempt the request preempts itself, or, when it is the only running request, the sequence
that cannot grow finishes with "length": the cache itself is its length limit.

n > 1 (parallel sampling): the parent prefills the prompt but its last token, then its n - 1
children are forked from it (scheduler/fork.py says how).

Prompt logprobs (SamplingParams.prompt_logprobs): such a request never reads the prefix cache
(nor the offload tier), as in vLLM: a cached position has no logits, and recomputing it is
what the request asks for anyway. Its sample 0 gets the prompt in its NewSeq and the workers
return the log-probabilities of the prompt tokens each chunk predicts (StepResult).

Protocol with the workers (scheduler/plan.py): plans execute in the order `schedule()`
returns them and are passed to `apply_result()` in that order; with async scheduling one plan
may be scheduled ahead of the result of the one before, and with micro-batches
(SchedulerConfig.micro_batches) up to that many disjoint plans are in flight (scheduler/ahead.py
owns what both mean). Slots are reserved, and num_computed advanced, when a chunk is scheduled; the KV cache
enters full blocks into the prefix cache at that point, so a request admitted later in the
same step may hit blocks this step computes (workers write the whole batch's KV before
attending). The scheduler deals in token ids and finish decisions only: text, stop strings
and output objects are the output processor's (cluster/engine/output_processor.py).

The Scheduler composes objects that each own their state: RequestQueues (scheduler/queues.py),
DecodeLane, Preemptor, Forker (scheduler/fork.py), ResultApplier (scheduler/results.py) and
PlansInFlight (ahead.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence

from kvcache import KVCacheManager, KVCacheStats, prompt_block_hashes
from kvcache.hashing import extra_key
from scheduler import ahead
from scheduler.ahead import PlansInFlight
from scheduler.config import SchedulerConfig
from scheduler.decode_lane import DecodeLane
from scheduler.fork import Forker
from scheduler.lora import LoRARequest, LoRASlots
from scheduler.outputs import SchedulerStats, StepOutcome
from scheduler.plan import StepPlan, StepResult
from scheduler.preemption import Preemptor
from scheduler.queues import RequestQueues
from scheduler.request import Request, Seq, SequenceStatus, check_prompt, check_resumable
from scheduler.results import ResultApplier
from scheduler.sampling_params import SamplingParams
from scheduler.speculative import SpeculativeConfig, Speculator
from scheduler.step_builder import StepBuilder

_RUNNING = SequenceStatus.RUNNING


class Scheduler:
    """Requests in, StepPlans out, token ids and finish decisions back (StepOutcome)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 eos_token_ids: Iterable[int] = (), vocab_size: int | None = None,
                 speculative: SpeculativeConfig | None = None) -> None:
        """vocab_size, when known, bounds the prompt token ids add_request accepts; with
        `speculative`, decodes may verify proposed tokens (scheduler/speculative.py)."""
        self.config = config
        self.kv = kv
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.vocab_size = vocab_size
        self.block_size = kv.block_size
        self.spec = Speculator(speculative) if speculative is not None else None
        self.inflight = PlansInFlight(config.micro_batches)
        self.lane = DecodeLane(kv.block_size, *self.inflight.lane_args(
            self.spec.lane_args() if self.spec else ()))
        self.lora = LoRASlots(config.max_loras)
        self.queues = RequestQueues(kv, self.lane, self.lora)
        mode = config.preemption_mode or ("swap" if kv.num_cpu_blocks > 0 else "recompute")
        self.preemptor = Preemptor(mode, kv, self.queues)
        self.results = ResultApplier(self.queues, self.lane, self.inflight, self.spec)
        self._seq_ids = itertools.count()
        self.forker = Forker(kv, self.queues, self.preemptor, self._seq_ids)
        self._step_id = 0
        self.prompt_tokens_total = 0

    @property
    def preemption_mode(self) -> str:
        return self.preemptor.mode

    @property
    def requests(self) -> dict[str, Request]:
        """Every unfinished request by id (read-only)."""
        return self.queues.requests

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, arrival_time: float | None = None,
                    cache_salt: str | None = None, output_token_ids: Sequence[int] = (),
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request; raise ValueError if it is malformed or could never be scheduled.

        `lora_request`: the adapter it runs under (None: the base model); its name joins the
        cache salt in the prefix cache's extra key (kvcache.hashing.extra_key).

        `output_token_ids`: a request resumed from another replica (which died or drained)
        arrives with the tokens it already generated there. They are recomputed with the
        prompt, then sampling goes on from output index len(output_token_ids): the prompt
        length, the length limit, min_tokens, penalties and a seeded stream's counter are
        those of the original request, so its tokens are the ones it would have drawn."""
        sp = sampling_params
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        if request_id in self.queues.requests:
            raise ValueError(f"request_id {request_id!r} is already in use; pick a unique id")
        if lora_request is not None and not self.config.max_loras:
            raise ValueError(f"request {request_id!r} names LoRA adapter "
                             f"{lora_request.lora_name!r}, but LoRA is off (max_loras=0); "
                             "start the engine with enable_lora=True")
        prompt = list(map(int, prompt_token_ids))
        check_prompt(request_id, prompt, sp, self.config, self.kv.num_gpu_blocks,
                     self.block_size, self.vocab_size)
        num_prompt = len(prompt)
        outputs = list(map(int, output_token_ids))
        parent = Seq(next(self._seq_ids), 0, prompt + outputs, num_prompt,
                     SequenceStatus.WAITING)
        req = Request(request_id, prompt, sp,
                      time.monotonic() if arrival_time is None else arrival_time,
                      extra_key(cache_salt, lora_request and lora_request.cache_key), parent,
                      self.eos_token_ids, self.config.max_model_len)
        req.lora_id = 0 if lora_request is None else lora_request.lora_int_id
        if outputs:
            check_resumable(req, outputs, self.vocab_size)
            req.forked = True  # its one sequence computes all it has, then samples
        self.results.watch_stop_ids(req.stop_token_ids)
        if self.kv.enable_prefix_caching:
            req.block_hashes = prompt_block_hashes(prompt, self.block_size, req.extra_key)
        if sp.n > 1 and num_prompt == 1:
            # Nothing to share before the first (and only) prompt token: start n independent
            # sequences.
            for i in range(1, sp.n):
                req.seqs.append(Seq(next(self._seq_ids), i, list(prompt), 1,
                                    SequenceStatus.WAITING))
            req.forked = True
        for seq in req.seqs:
            seq.max_len = seq.prompt_len + req.max_output
        self.queues.add(req)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request in any state now, freeing its blocks; its sequences that were live
        are FINISHED_ABORTED. None for an unknown (or finished) id."""
        return self.queues.abort(request_id)

    def stop_sequence(self, seq_id: int, stop_reason: str) -> None:
        """Finish a live sequence with "stop" for a reason found outside the scheduler (a stop
        string in its text); a later token for it is ignored. Unknown ids are ignored (the
        sequence finished or was aborted meanwhile)."""
        entry = self.queues.seqs.get(seq_id)
        if entry is not None:
            self.queues.finish_seq(*entry, SequenceStatus.FINISHED_STOPPED, stop_reason)

    def reset_for_recompute(self) -> None:
        """The workers lost their state (a rank died; the engine rebuilt the group with empty
        caches): every unfinished request goes back to waiting, at the front in admission
        order, to recompute its prompt plus the tokens it has; the KV cache is emptied and
        the plans in flight are forgotten (their tokens never arrived: they are sampled
        again, and a seeded stream draws the same ones). Outputs already decided are kept."""
        self.kv.reset()
        self.lane.reset()
        self.queues.requeue_all()
        self.lora.reset()
        self.inflight.clear()

    def has_unfinished(self) -> bool:
        return bool(self.queues.requests)

    # ---- results ----------------------------------------------------------------------------

    def apply_result(self, plan: StepPlan, result: StepResult | None) -> StepOutcome:
        """Append the sampled tokens, decide stop tokens and lengths, and return the outcome.

        `result` may be None for a plan in which no sequence samples. Tokens of sequences
        that finished or were aborted while the step ran are ignored.
        """
        return self.results.apply(plan, result)

    # ---- schedule ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Decide the next step (see the module docstring) and return its plan."""
        self.inflight.check_room()
        self._step_id += 1
        queues = self.queues
        cfg = self.config
        step = StepBuilder(self._step_id, cfg.max_num_batched_tokens,
                           self.inflight.seq_slots(cfg.max_num_seqs, queues), queues.drops)

        # 1. Decodes (and n > 1 forks: every sequence computes one token).
        prefill_reqs = self._schedule_decodes(step)
        step.cap_prefill(cfg.max_mixed_prefill_tokens)

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

        if not step.preempted and (queues.swapped or queues.waiting) and self.inflight.may_admit():
            self._schedule_resumed_and_new(step)
        if self.spec is not None and self.spec.shrunk:
            self.spec.resend_tables(step, self.kv)
        queues.drops = []  # (the plan carries the list it had)
        self.inflight.launch(step.step_id, step.preempted)
        return step.to_plan(*self.kv.take_transfers(), self.lora.take_loads())

    def _schedule_resumed_and_new(self, step: StepBuilder) -> None:
        """Stages 3 and 4: swapped requests back in, then waiting ones admitted."""
        queues, kv, cfg = self.queues, self.kv, self.config
        num_seqs = queues.num_running_seqs()
        # 3. Swapped requests come back before any new one is admitted.
        while queues.swapped and step.budget and step.seq_slots:
            req = queues.swapped[0]
            if num_seqs + queues.reserved_seqs(req) > cfg.max_num_seqs \
                    or not self._place_adapter(req):
                break
            ids = [s.seq_id for s in req.live_seqs() if kv.has_seq(s.seq_id)]
            if not kv.can_swap_in(ids):
                if queues.running:
                    break
                # Alone on an idle GPU and still over the watermark: recompute it instead.
                self.preemptor.free_for_recompute(queues.swapped_to_waiting())
                continue
            step.swap_in.extend(kv.swap_in(ids))
            queues.resume_swapped()
            num_seqs += queues.reserved_seqs(req)
            self._schedule_request(req, step)
        # 4. Waiting requests, FCFS.
        while not queues.swapped and queues.waiting and step.budget and step.seq_slots:
            req = queues.waiting[0]
            if num_seqs + queues.reserved_seqs(req) > cfg.max_num_seqs \
                    or not self._place_adapter(req):
                break
            # The watermark keeps headroom for running requests to grow; alone, use it all.
            admit = bool(queues.running)
            live = req.live_seqs()
            if self._schedule_seq(req, live[0], step, admit=admit) <= 0:
                break
            queues.admit()
            num_seqs += queues.reserved_seqs(req)
            if not req.admitted:
                req.admitted = True
                self.prompt_tokens_total += len(req.prompt_token_ids)
            for seq in live[1:]:
                if step.budget == 0 or step.seq_slots == 0:
                    break
                self._schedule_seq(req, seq, step, admit=admit)

    def _place_adapter(self, req: Request) -> bool:
        """Make the request's adapter resident before it (re)starts running (scheduler/lora.py);
        False when every slot is pinned by running requests of other adapters: it waits."""
        if not req.lora_id:
            return True
        if not self.lora.can_place(req.lora_id):
            return False
        req.lora_slot = self.lora.place(req.lora_id)
        return True

    def _schedule_decodes(self, step: StepBuilder) -> list[Request]:
        """Stage 1: a token for every running sequence that decodes (and the n > 1 forks due):
        the decode lane's members in bulk when it runs, then the rest one by one. Returns the
        running requests with prefill chunks left, for stage 2."""
        rest = self.lane.schedule(step, self.queues.running, self.kv, self.inflight.ahead)
        prefill_reqs: list[Request] = []
        self._decode_one_by_one(rest, step, prefill_reqs)
        return prefill_reqs

    def _decode_one_by_one(self, reqs: list[Request], step: StepBuilder,
                           prefill_reqs: list[Request]) -> None:
        """Stage 1 for these running requests, in order, one sequence at a time (appending
        to prefill_reqs those with prefill chunks left). A sequence that cannot get its slot
        is _schedule_seq's (preemption); one that the workers hold and that got its slot
        without copy-on-write joins the decode lane."""
        kv = self.kv
        allocate = kv.allocate_slots
        join = self.lane.join if self.lane.joining else None
        spec = self.spec if self.spec and self.spec.enabled_for(self.queues.num_running_seqs()) else None
        for req in reqs:
            if step.budget == 0 or step.seq_slots == 0:
                break
            if req.status is not _RUNNING:
                continue
            if not req.forked:
                parent = req.seqs[0]
                if parent.num_computed == parent.prompt_len - 1:
                    self.forker.schedule(req, step, may_preempt=True)
                else:
                    prefill_reqs.append(req)
                continue
            has_prefill = False
            for seq in req.seqs:
                if seq.status is not _RUNNING:
                    continue
                pending = self.inflight.decode_pending(seq)
                if pending is None:
                    # a prefill chunk left, or its tokens are being computed already
                    has_prefill = has_prefill or seq.num_computed < len(seq.token_ids)
                    continue
                if step.budget == 0 or step.seq_slots == 0:
                    break
                drafts = spec.propose(req, seq, step.budget) if spec is not None else None
                if drafts:
                    alloc = allocate(seq.seq_id, seq.token_ids, 1 + len(drafts), len(drafts))
                    if alloc is not None:
                        step.add(req, seq, alloc, seq.num_computed, 1 + len(drafts), kv, drafts)
                        continue
                alloc = allocate(seq.seq_id, seq.token_ids, 1, pending)
                if alloc is None:
                    if self._schedule_seq(req, seq, step, may_preempt=True) < 0:
                        break  # the request itself was preempted
                    continue
                plain = seq.on_worker and not alloc.copies
                step.add(req, seq, alloc, seq.num_computed, 1, kv)
                if plain and join is not None and req.n == 1:
                    join(req, seq)
            if has_prefill:
                prefill_reqs.append(req)

    def _schedule_request(self, req: Request, step: StepBuilder) -> None:
        """Schedule every live sequence of a request just swapped back in, preempting nobody."""
        if not req.forked:
            parent = req.seqs[0]
            if parent.num_computed == parent.prompt_len - 1:
                self.forker.schedule(req, step, may_preempt=False)
                return
        for seq in req.seqs:
            if seq.status is _RUNNING and req.target_len(seq) > seq.num_computed:
                if step.budget == 0 or step.seq_slots == 0:
                    return
                self._schedule_seq(req, seq, step)

    def _schedule_seq(self, req: Request, seq: Seq, step: StepBuilder, admit: bool = False,
                      may_preempt: bool = False) -> int:
        """Reserve slots for the sequence's next chunk and add it to the step.

        Returns the tokens scheduled (> 0), 0 when nothing was scheduled, or -1 when the
        request had to preempt itself.
        """
        kv = self.kv
        while True:
            computed = seq.num_computed
            prefix: list[int] = []
            loaded: list[int] = []  # continues prefix: blocks loaded from the offload tier
            # A request with prompt logprobs reads no cached prefix: cached positions have no
            # logits, so its whole prompt is computed (its blocks still enter the cache).
            if (computed == 0 and not kv.has_seq(seq.seq_id)
                    and req.sampling_params.prompt_logprobs is None):
                prefix = kv.lookup_prefix(seq.token_ids, req.extra_key, req.block_hashes)
                loaded = kv.lookup_offloaded(seq.token_ids, len(prefix), req.extra_key,
                                             req.block_hashes)
                computed = (len(prefix) + len(loaded)) * self.block_size
                if not req.forked and computed and computed >= seq.prompt_len - 1:
                    # an unforked parent computes >= 1 token before forking
                    computed -= self.block_size
                    del (loaded if loaded else prefix)[-1]
            pending = ahead.num_pending(seq)
            to_compute = req.target_len(seq) + pending - computed
            chunk = min(to_compute, step.budget)
            if chunk <= 0 or (chunk < to_compute and not self.config.enable_chunked_prefill):
                return 0
            if kv.has_seq(seq.seq_id):
                alloc = kv.allocate_slots(seq.seq_id, seq.token_ids, chunk, pending)
            else:
                alloc = kv.allocate_new(seq.seq_id, seq.token_ids, chunk, prefix, req.extra_key,
                                        admit, req.block_hashes, loaded)
            if alloc is not None:
                break
            if not may_preempt:
                return 0
            if self.preemptor.make_room(req, step):
                continue
            if req.scheduled_step == step.step_id:
                return 0  # some of its sequences already run this step: wait for the next
            if len(self.queues.running) > 1:
                self.preemptor.preempt(req, step)
                return -1
            if not ahead.waits_for_token(seq):
                self._finish_for_capacity(req, seq)
            return 0
        if (prefix or loaded) and not req.admitted:
            req.num_cached_tokens = computed
        step.add(req, seq, alloc, computed, chunk, kv)
        return chunk

    def _finish_for_capacity(self, req: Request, seq: Seq) -> None:
        """The only running request cannot grow: the cache is its length limit."""
        self.queues.finish_seq(req, seq, SequenceStatus.FINISHED_LENGTH)
        self.results.finished_early(req, seq)

    def check_lane(self) -> None:
        """Assert the decode lane mirrors the sequences' state (for tests, between calls)."""
        self.lane.check(self.queues.running, self.kv.num_slots)

    # ---- metrics ----------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        kv = self.kv.stats()
        queues = self.queues
        return SchedulerStats(
            num_waiting=len(queues.waiting),
            num_running=len(queues.running),
            num_swapped=len(queues.swapped),
            num_running_seqs=queues.num_running_seqs(),
            preemptions_swap=self.preemptor.num_swapped,
            preemptions_recompute=self.preemptor.num_recomputed,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.results.generation_tokens_total,
            num_steps=self._step_id,
            **{name: getattr(kv, name) for name in KVCacheStats.__dataclass_fields__},
        )
