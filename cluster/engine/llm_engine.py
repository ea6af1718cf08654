"""The engine core: one model replica's scheduler, KV cache manager, executor and output
processor, stepped by `step()`. The offline `LLM` drives it directly; `AsyncLLMEngine`
(async_llm_engine.py) runs it as an asyncio service.

`LLMEngine` owns every request and every KV block of its replica. Invariants: a plan is
applied in the order it was submitted, and results are asked for in that order; with async
scheduling at most two plans are in flight (the one running and the one scheduled after it);
at pipeline_parallel_size pp > 1, pp plans of disjoint sequences (micro-batches, vLLM's batch
queue: scheduler/ahead.py) are in flight, so that every stage has one to run; this replaces
async scheduling's plan ahead there (executor.plans_in_flight says why).

Structured outputs (structured_output.py) hook in at three points: a plan's constrained rows
are marked when it is scheduled; a step's tokens advance the matchers when its result is
applied; and the oldest plan in flight gets its bitmask once every plan before it has been
applied (at submit when it is the only one, else right after its predecessor's result), while
its forward pass runs.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import time
from collections import deque
from typing import Any

from cluster.engine.config import EngineConfig
from cluster.engine.engine_setup import (
    MIN_BATCHED_TOKENS,
    build_executor,
    build_worker_config,
    check_layer_partition,
    default_sampling,
    freeze_startup_heap,
    rebuild_or_raise,
    weights_bytes,
)
from cluster.engine.executor import Executor, WorkerDiedError, plans_in_flight
from cluster.engine.fast_detokenizer import detokenizer_factory
from cluster.engine.kv_transfers import KVTransfers
from cluster.engine.kv_transport import KVTransferParams
from cluster.engine.lora import LoRAHostCache
from cluster.engine.metrics import LatencyMetrics, RequestTimes
from cluster.engine.output_processor import OutputProcessor
from cluster.engine.pooling import resolve_pooling
from cluster.engine.structured_output import StructuredOutputManager
from kvcache import KVCacheManager
from scheduler import (
    RequestOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    StepResult,
)
from scheduler.lora import LoRARequest
from scheduler.request import check_prompt_fits
from scheduler.speculative import SpeculativeConfig
from workers.draft_runner import check_draft_fits
from workers.model_config import load_model_config
from workers.tiny_model import resolve_model

logger = logging.getLogger(__name__)

class LLMEngine:
    """Owns one model replica: every request, every KV block, every step."""

    def __init__(self, config: EngineConfig, placement_group: Any = None) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.model_name = config.model
        self.model_path = resolve_model(config.model)
        self.model_config = load_model_config(self.model_path, config.tensor_parallel_size,
                                              config.hf_overrides, config.quantization,
                                              config.load_format)
        config.check_host_memory(weights_bytes(config, self.model_path, self.model_config),
                                 os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        self.max_model_len = config.max_model_len or self.model_config.max_context_len
        self.model_config.check_max_model_len(self.max_model_len)
        check_layer_partition(config, self.model_config.num_hidden_layers)
        batched = config.max_num_batched_tokens or max(self.max_model_len, MIN_BATCHED_TOKENS)
        self.default_sampling = default_sampling(self.model_path, config.generation_config)
        spec = (SpeculativeConfig.from_dict(config.speculative_config)
                if config.speculative_config is not None else None)
        draft_path = (self._check_draft(spec.model, config.tensor_parallel_size)
                      if spec is not None and spec.model is not None else None)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if draft_path is not None and (AutoTokenizer.from_pretrained(draft_path).get_vocab()
                                       != self.tokenizer.get_vocab()):
            raise ValueError(f"speculative_config.model {spec.model!r} has another tokenizer than "
                             f"the target {self.model_name!r}; a draft must share its tokenizer")
        # the pooling runner's (cluster/engine/pooling.py); None: the generate runner
        self.pooling = resolve_pooling(self.model_path, config, self.tokenizer)
        if config.uses_ray:
            import ray

            if not ray.is_initialized():
                ray.init(ignore_reinit_error=True, log_to_driver=False)
        # Ray workers run where Ray places them; an in-process worker runs here.
        self.device = config.resolve_device(from_ray=config.uses_ray)
        worker_config = build_worker_config(config, self.model_path, self.device,
                                            self.max_model_len, batched, spec, draft_path,
                                            self.pooling)
        # LoRA adapters this engine knows and the host copies it keeps (cluster/engine/lora.py)
        self.loras = (LoRAHostCache(self.model_config, config.max_lora_rank,
                                    config.max_cpu_loras or config.max_loras)
                      if config.enable_lora else None)
        self.async_scheduling = self.pooling is None and (
            config.async_scheduling if config.async_scheduling is not None
            else self.device == "cuda")
        if spec is not None and self.async_scheduling:
            logger.info("speculative decoding is on: async scheduling is turned off (a verify "
                        "step's token count is known only once its result is in)")
            self.async_scheduling = False
        # plans submitted before the oldest one's result is waited for
        self.plans_in_flight = plans_in_flight(config.pipeline_parallel_size,
                                               self.async_scheduling)
        self.executor: Executor = build_executor(
            config, worker_config, self.device, placement_group,
            self.async_scheduling and config.pipeline_parallel_size == 1)
        try:  # (a start that fails from here on must not keep the workers' device memory)
            kv = KVCacheManager(
                self.executor.num_gpu_blocks, self.executor.num_cpu_blocks, config.block_size,
                enable_prefix_caching=config.enable_prefix_caching
                and not (self.pooling and self.pooling.pooler.accumulates),
                num_offload_blocks=self.executor.num_offload_blocks)
            preemption = config.preemption_mode or (
                "swap" if self.executor.num_cpu_blocks > 0 else "recompute")
            self.scheduler = Scheduler(
                SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=batched,
                                max_model_len=self.max_model_len, preemption_mode=preemption,
                                max_loras=worker_config.max_loras,
                                micro_batches=config.pipeline_parallel_size,
                                max_mixed_prefill_tokens=config.max_mixed_prefill_tokens),
                kv, eos_token_ids=self.model_config.eos_token_ids,
                vocab_size=len(self.tokenizer), speculative=spec)
            self.output_processor = OutputProcessor(self.scheduler, self.tokenizer,
                                                    detokenizer_factory(self.tokenizer))
            self.structured = StructuredOutputManager(
                self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids,
                disable_any_whitespace=config.disable_any_whitespace)
            self.kv_transfers = KVTransfers(self)  # prefill/decode disaggregation's (kv_role)
        except BaseException:
            self.executor.shutdown()
            raise
        self.latency = LatencyMetrics()
        self._times: dict[str, RequestTimes] = {}
        self.num_steps = 0
        self.forward_seconds = 0.0
        self.step_seconds = 0.0
        # Plans submitted and not yet applied, oldest first: (plan, executor handle or None
        # for a plan with nothing for the workers, time its scheduling began).
        self._inflight: deque[tuple[StepPlan, Any, float]] = deque()
        self._last_done = 0.0  # when the last step's result was applied
        self.max_plans_in_flight = 0  # the most plans the workers held at once (a metric)
        self.recoveries = 0  # tensor-parallel groups rebuilt after a rank died
        freeze_startup_heap()

    def _check_draft(self, model: str, tp: int) -> str:
        """The draft's checkpoint directory; ValueError unless it shares the target's
        vocabulary and KV layout (workers/draft_runner.py; its tokenizer is compared after)."""
        try:
            path = resolve_model(model)
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        check_draft_fits(self.model_config, load_model_config(path, tp), tp)
        return path

    # ----- requests ---------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """What a request that sets no sampling parameter gets (EngineConfig.generation_config)."""
        return SamplingParams(**self.default_sampling)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that can never run; changes nothing."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; send at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)),
                   None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias names token id {max(params.logit_bias)}, outside the "
                             f"vocabulary [0, {vocab})")
        check_prompt_fits(n, params, self.max_model_len)
        self.output_processor.validate(params)
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)  # cached for add_request

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Know (and load, checking it) a LoRA adapter; ValueError for a bad one or with LoRA
        off. Idempotent: requests name it afterwards."""
        if self.loras is None:
            raise ValueError(f"LoRA adapter {getattr(lora_request, 'lora_name', lora_request)!r} "
                             "requested, but LoRA is off; start the engine with enable_lora=True")
        self.loras.add(lora_request)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, cache_salt: str | None = None,
                    output_token_ids: list[int] | None = None,
                    lora_request: LoRARequest | None = None, export_kv: bool = False,
                    kv_transfer_params: KVTransferParams | None = None) -> None:
        """Queue a request. `output_token_ids`: it is resumed from another replica with the
        tokens it generated there (Scheduler.add_request); its deltas start after them.
        `lora_request`: the adapter it runs under (None: the base model). `export_kv` (a
        prefill engine's): its last output carries its prompt's KV as `kv_transfer_params`;
        `kv_transfer_params` (a decode engine's): that KV, imported before it is admitted
        with the first token as output (cluster/engine/kv_transfers.py)."""
        params = params or self.default_sampling_params()
        self.validate(prompt_token_ids, params)
        if lora_request is not None:
            self.add_lora(lora_request)
        if export_kv:
            self.kv_transfers.mark_export(request_id, params, cache_salt, lora_request)
        if kv_transfer_params is not None:
            self.kv_transfers.receive(request_id, prompt_token_ids, params, cache_salt,
                                      lora_request, kv_transfer_params)
            return
        self.queue_request(request_id, prompt_token_ids, params, cache_salt, output_token_ids,
                           lora_request)

    def queue_request(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, cache_salt: str | None,
                      output_token_ids: list[int] | None,
                      lora_request: LoRARequest | None) -> None:
        """add_request's admission, after its checks."""
        outputs = list(output_token_ids or ())
        self.scheduler.add_request(request_id, list(prompt_token_ids), params,
                                   cache_salt=cache_salt, output_token_ids=outputs,
                                   lora_request=lora_request)
        if params.structured_outputs is not None:
            self.structured.add_request(request_id, params.structured_outputs)
            if outputs:  # the matcher is where the grammar was after those tokens
                seq_id = self.scheduler.requests[request_id].seqs[0].seq_id
                self.structured.add_seq(seq_id, request_id, 0)
                self.structured.accept(seq_id, outputs)
        self.output_processor.add_request(request_id, prompt_token_ids, params, outputs)
        self._times[request_id] = RequestTimes(arrival=time.perf_counter())

    def abort(self, request_id: str) -> RequestOutput | None:
        self.kv_transfers.forget(request_id)
        out = self.output_processor.abort(request_id)
        self.structured.release(request_id)
        times = self._times.pop(request_id, None)
        if out is not None and times is not None:
            self.latency.on_finished(times, time.perf_counter(), "abort")
        return out

    def has_unfinished(self) -> bool:
        """Requests in the scheduler, or plans whose results are still to be applied."""
        return (self.scheduler.has_unfinished() or bool(self._inflight)
                or self.kv_transfers.pending)

    def park(self) -> None:
        """Idle: let the workers wait without burning CPU; the next step wakes them."""
        if not self._inflight:
            self.executor.park()

    def resume_after_rebuild(self) -> None:
        """The executor rebuilt its workers (empty caches): every unfinished request goes back
        to recompute from its prompt and the tokens it has; the plans in flight are dropped."""
        self.scheduler.reset_for_recompute()
        self._inflight.clear()
        self.recoveries += 1

    # ----- stepping ---------------------------------------------------------------------
    #
    # A step: make sure the next plan is submitted, then wait for the oldest plan's result
    # and apply it. With async_scheduling the plan after it is scheduled and submitted before
    # that wait, so the scheduler's work for step N+1 overlaps step N's forward pass and the
    # workers find N+1 waiting when N ends (see scheduler/scheduler.py for what is safe).

    def step(self) -> list[RequestOutput]:
        """One step; a worker that died is replaced (see AsyncLLMEngine) and the step's
        requests recomputed, the step then returning no outputs."""
        try:
            plan, result, start = self.next_step()
            return self.finish_step(plan, None if result is None else result.result(), start)
        except WorkerDiedError as e:
            rebuild_or_raise(self.executor, e)
            self.resume_after_rebuild()
            return []

    def next_step(self) -> tuple[StepPlan, concurrent.futures.Future | None, float]:
        """Submit plans until `plans_in_flight` are in flight (one; with async scheduling also
        the one after the step in flight; pp micro-batches) and hand back the oldest step in
        flight: its plan, a future of its StepResult (None when nothing went to the workers)
        and when its scheduling began, for `finish_step`."""
        if not self._inflight:
            self.kv_transfers.admit_ready()  # (KV imports: only with nothing in flight)
            self._submit()
        while (len(self._inflight) < self.plans_in_flight
               and self.scheduler.has_unfinished() and not self.kv_transfers.pending):
            self._submit()
        plan, handle, start = self._inflight.popleft()
        return plan, None if handle is None else self.executor.result(handle), start

    def _submit(self) -> None:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        for load in plan.lora_loads:  # (the scheduler chose the slot; the tensors are ours)
            load.weights = self.loras.weights(load.lora_id)
        for new in plan.new_seqs:  # (first schedule, or a resume: the first one counts)
            times = self._times.get(new.request_id)
            if times is not None and times.scheduled is None:
                times.scheduled = start
        if self.structured.active:
            self.structured.mark(plan)
        # A plan with nothing for the workers (everyone waits on a token in flight) stays here.
        handle = None if plan.is_noop else self.executor.submit(plan)
        self._inflight.append((plan, handle, start))
        self.max_plans_in_flight = max(self.max_plans_in_flight,
                                       sum(h is not None for _, h, _ in self._inflight))
        if len(self._inflight) == 1:
            self._provide_bitmask()

    def _provide_bitmask(self) -> None:
        """The oldest plan in flight samples once it has its constrained rows' bitmask: every
        plan before it has been applied, so the matchers are where its sequences are."""
        plan, handle, _ = self._inflight[0]
        if plan.num_constrained and handle is not None:
            self.executor.provide_bitmask(handle, self.structured.bitmask(plan))

    def finish_step(self, plan: StepPlan, result: StepResult | None, start: float,
                    defer_text: bool = False) -> list[RequestOutput]:
        """Apply a step's result (Scheduler.apply_result: tokens and finish decisions), make
        its output deltas (OutputProcessor.process: text, stop strings, logprobs; with
        defer_text, the text of sequences without stop strings waits for finish_text) and
        record its timing."""
        outputs = self.output_processor.process(self.scheduler.apply_result(plan, result),
                                                defer_text)
        if self.structured.active:
            self.structured.on_result(plan, result, outputs)
        if self.kv_transfers.role == "prefill":
            self.kv_transfers.on_outputs(outputs)
        if self._inflight:  # (even with no constrained request left: one may be in flight)
            self._provide_bitmask()
        now = time.perf_counter()
        for out in outputs:
            times = self._times.get(out.request_id)
            if times is None:
                continue
            self.latency.on_tokens(times, now, sum(len(c.token_ids) for c in out.outputs))
            if out.finished:
                reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
                self.latency.on_finished(times, now, reason)
                del self._times[out.request_id]
        if not plan.is_empty:
            self.num_steps += 1
            self.forward_seconds += result.forward_seconds
            # Wall time this step added: with a plan scheduled ahead, from the previous
            # step's end, not from when this plan was scheduled.
            self.step_seconds += now - max(start, self._last_done)
        self._last_done = now
        return outputs

    # ----- observability ----------------------------------------------------------------

    def _spec_metrics(self) -> dict[str, Any]:
        """vLLM's speculative decoding counters (zeros with speculation off)."""
        spec = self.scheduler.spec
        if spec is None:
            return {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                    "spec_decode_num_accepted_tokens": 0,
                    "spec_decode_num_accepted_tokens_per_pos": []}
        return {"spec_decode_num_drafts": spec.num_drafts,
                "spec_decode_num_draft_tokens": spec.num_draft_tokens,
                "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(spec.accepted_per_pos)}

    def metrics(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        return {
            "num_requests_running": s.num_running,
            "num_requests_waiting": s.num_waiting,
            "num_requests_swapped": s.num_swapped,
            "kv_cache_usage_perc": s.gpu_usage,
            "prefix_cache_queries": s.prefix_queries,
            "prefix_cache_hits": s.prefix_hits,
            "external_prefix_cache_queries": s.external_prefix_queries,
            "external_prefix_cache_hits": s.external_prefix_hits,
            "kv_offload_blocks_offloaded": s.blocks_offloaded,
            "kv_offload_blocks_loaded": s.blocks_loaded,
            "kv_offload_usage_perc": s.offload_usage,
            "prompt_tokens_total": s.prompt_tokens_total,
            "generation_tokens_total": s.generation_tokens_total,
            "num_preemptions_swap": s.preemptions_swap,
            "num_preemptions_recompute": s.preemptions_recompute,
            "num_worker_recoveries": self.recoveries,
            **self.kv_transfers.stats(),
            "max_plans_in_flight": self.max_plans_in_flight,
            **self._spec_metrics(),
            "request_success_total": dict(self.latency.finished),
            "time_to_first_token_seconds": self.latency.ttft.copy(),
            "inter_token_latency_seconds": self.latency.itl.copy(),
            "e2e_request_latency_seconds": self.latency.e2e.copy(),
            "request_queue_time_seconds": self.latency.queue.copy(),
            "request_prefill_time_seconds": self.latency.prefill.copy(),
            "request_decode_time_seconds": self.latency.decode.copy(),
            "request_inference_time_seconds": self.latency.inference.copy(),
        }

    def overhead_fraction(self) -> float:
        """Share of step wall time spent outside rank 0's forward pass (control plane)."""
        if self.step_seconds == 0:
            return 0.0
        return max(0.0, 1.0 - self.forward_seconds / self.step_seconds)

    def shutdown(self) -> None:
        # Back to the collector first, so an engine shut down in a process that lives on
        # (tests, a notebook, a benchmark building the next engine) frees its device memory
        # in the executor's collect, cycles included.
        gc.unfreeze()
        self.kv_transfers.shutdown()
        self.executor.shutdown()

