"""`AsyncLLMEngine`: the engine as an asyncio service, for a Serve replica.

`generate` streams one request's output deltas from its own queue; a background task steps
the `LLMEngine` while any request is unfinished, parks the workers when none is, probes them
when idle so a dead rank is found within seconds, and rebuilds the tensor-parallel group after
one died (each unfinished request resumes by recompute). Its invariants are the class's.

Two things for the cluster's failover: `generate(resume_token_ids=...)` re-admits a request
another replica started (it goes on from the tokens it has, see LLMEngine.add_request), and
`check_health` fails once the loop has made no step for `engine_stall_timeout_s` while it had
work (a hung collective, a wedged device), so Serve replaces a replica that still answers
pings but serves nobody.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from cluster.engine.config import EngineConfig
from cluster.engine.engine_setup import rebuild_or_raise
from cluster.engine.errors import (
    EngineDeadError,
    EngineRecoveringError,
    EngineStalledError,
    OverloadedError,
)
from cluster.engine.executor import WorkerDiedError
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.lora import lora_metrics
from kvcache.events import KVEventBatch
from scheduler import QueueLoad, RequestOutput, SamplingParams
from scheduler.lora import LoRARequest

logger = logging.getLogger(__name__)

# How often an idle engine probes its workers, so a dead one is noticed within seconds.
_HEALTH_PROBE_SECONDS = 2.0


class AsyncLLMEngine:
    """The engine as an asyncio service: `generate` streams deltas, a background task steps.

    Invariants: scheduler state changes only on the event loop's thread, never while
    `schedule()` or `apply_result()` runs; aborts that arrive during a step are applied
    right after it, so a plan in flight never refers to freed blocks' new owners.
    """

    def __init__(self, config: EngineConfig, placement_group: Any = None) -> None:
        self.engine = LLMEngine(config, placement_group)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.model_name = self.engine.model_name
        self.default_sampling = self.engine.default_sampling  # (generation_config)
        self.pooling = self.engine.pooling  # the pooling runner's (None: generate)
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending_aborts: set[str] = set()
        self._stepping = False
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._dead: str | None = None
        self._recovering: str | None = None  # why, while the workers are being rebuilt
        # When the loop last made progress (a step applied, work picked up after idling).
        self._last_progress = time.monotonic()
        self.lora_requests_total: dict[str, int] = {}  # requests admitted per adapter name

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None,
                       cache_salt: str | None = None,
                       resume_token_ids: list[int] | None = None,
                       lora_request: LoRARequest | None = None, export_kv: bool = False,
                       kv_transfer_params: Any = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's output deltas. `resume_token_ids`: the tokens it already
        generated on another replica; the deltas start after them. `lora_request`: the adapter
        it runs under (None: the base model), loaded and checked on first use. `export_kv` /
        `kv_transfer_params`: prefill/decode disaggregation's (LLMEngine.add_request)."""
        self.check_health()
        self._ensure_loop()
        request_id = request_id or uuid.uuid4().hex
        if sampling_params.structured_outputs is not None:  # compiled off the event loop
            await self.engine.structured.compile_async(sampling_params.structured_outputs)
        queue: asyncio.Queue = asyncio.Queue()
        if self.config.max_waiting_requests is not None:
            waiting = self.engine.scheduler.stats().num_waiting
            if waiting >= self.config.max_waiting_requests:
                raise OverloadedError(f"{waiting} requests are already waiting "
                                      f"(max_waiting_requests={self.config.max_waiting_requests})")
        if not self.engine.has_unfinished():
            self._last_progress = time.monotonic()  # idle until now: not a stall
        self.engine.add_request(request_id, prompt_token_ids, sampling_params, cache_salt,
                                resume_token_ids, lora_request=lora_request,
                                export_kv=export_kv, kv_transfer_params=kv_transfer_params)
        if lora_request is not None and not resume_token_ids:
            name = lora_request.lora_name
            self.lora_requests_total[name] = self.lora_requests_total.get(name, 0) + 1
        self._queues[request_id] = queue
        assert self._wake is not None
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort_soon(request_id)

    def _abort_soon(self, request_id: str) -> None:
        if self._stepping:
            self._pending_aborts.add(request_id)
        elif self._dead is None:
            self.engine.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_soon(request_id)
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(asyncio.CancelledError(f"request {request_id} aborted"))

    async def _run(self) -> None:
        """The step loop (LLMEngine.step's, awaiting instead of blocking). A step's outputs go
        out while the next step runs: finish_step takes every decision at once (stop
        tokens, stop strings, lengths, freed blocks) but leaves the text of sequences without
        stop strings out; the next plan is scheduled and submitted (with async scheduling, the one after
        it too), and only then is that text detokenized and the deltas delivered, overlapping
        the forward pass (on other processes with Ray, on the GPU with CUDA)."""
        assert self._wake is not None
        engine = self.engine
        undelivered: list[RequestOutput] = []
        try:
            while True:
                if not engine.has_unfinished():
                    self._deliver(undelivered)
                    undelivered = []
                    engine.park()
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), _HEALTH_PROBE_SECONDS)
                    except TimeoutError:
                        try:
                            await asyncio.to_thread(engine.executor.ping)
                        except WorkerDiedError as e:
                            await self._recover(e)
                    continue
                self._stepping = True
                try:
                    plan, future, start = engine.next_step()
                    self._deliver(undelivered)  # the previous step's, while this one runs
                    undelivered = []
                    await asyncio.sleep(0)  # consumers (HTTP streams) take them now
                    result = None
                    if future is not None:  # (on a thread: the wait may block on the device)
                        result = (future.result() if future.done()
                                  else await asyncio.to_thread(future.result))
                except WorkerDiedError as e:
                    self._stepping = False
                    await self._recover(e)
                    self._apply_pending_aborts()
                    continue
                finally:
                    self._stepping = False
                undelivered = engine.finish_step(plan, result, start, defer_text=True)
                self._last_progress = time.monotonic()
                self._apply_pending_aborts()
        except Exception as e:  # noqa: BLE001 — anything here kills the engine; say why
            self._die(e)

    def _apply_pending_aborts(self) -> None:
        for request_id in self._pending_aborts:
            self.engine.abort(request_id)
        self._pending_aborts.clear()

    async def _recover(self, error: WorkerDiedError) -> None:
        """A rank died: rebuild the tensor-parallel group (new actors in the replica's
        placement group, weights reloaded, empty caches) and resume every unfinished request
        by recompute, so streams go on where they were. Not ready meanwhile (/health is 503).
        Raises WorkerDiedError when MAX_REBUILD_ATTEMPTS rebuilds failed: the engine dies."""
        self._recovering = str(error)
        logger.warning("engine: %s; rebuilding the tensor-parallel workers", error)
        start = time.perf_counter()
        try:
            await asyncio.to_thread(rebuild_or_raise, self.engine.executor, error)
        finally:
            self._recovering = None
            self._last_progress = time.monotonic()
        self.engine.resume_after_rebuild()
        logger.warning("engine: workers rebuilt in %.1f s; %d requests resume by recompute",
                       time.perf_counter() - start, len(self.engine.scheduler.requests))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Fill in the text finish_step deferred and hand each delta to its request's queue."""
        self.engine.output_processor.finish_text()
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _die(self, error: BaseException) -> None:
        self._dead = (str(error) if isinstance(error, WorkerDiedError)
                      else f"engine loop failed: {type(error).__name__}: {error}")
        err = EngineDeadError(self._dead)
        for queue in self._queues.values():
            queue.put_nowait(err)
        self._queues.clear()

    def check_health(self) -> None:
        """Raise EngineDeadError when the engine cannot serve again. A dead worker is not
        that: the step loop rebuilds the workers (see check_ready). EngineStalledError when
        the loop has had work and made no step for engine_stall_timeout_s."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        stalled = time.monotonic() - self._last_progress
        if (stalled > self.config.engine_stall_timeout_s and self._recovering is None
                and self.engine.has_unfinished()):
            raise EngineStalledError(
                f"the engine loop has made no step for {stalled:.1f} s with "
                f"{len(self.engine.scheduler.requests)} requests "
                f"(engine_stall_timeout_s={self.config.engine_stall_timeout_s})")

    def check_ready(self) -> None:
        """check_health, and EngineRecoveringError while a worker is dead or being rebuilt."""
        self.check_health()
        if self._recovering is not None:
            raise EngineRecoveringError(f"rebuilding the workers: {self._recovering}")
        try:
            self.engine.executor.check_health()
        except WorkerDiedError as e:
            raise EngineRecoveringError(f"a worker died; rebuilding: {e}") from e

    def metrics(self) -> dict[str, Any]:
        """LLMEngine.metrics, plus the adapters' (cluster/engine/lora.py `lora_metrics`)."""
        return {**self.engine.metrics(),
                **lora_metrics(self.engine, self.lora_requests_total)}

    def lora_names(self) -> list[str]:
        """The adapters this engine has loaded and not removed."""
        return sorted(self.engine.loras.names) if self.engine.loras is not None else []

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter now, not at its first request (ValueError if bad)."""
        self.engine.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Forget an adapter (cluster/engine/lora.py `LoRAHostCache.remove`); False if
        unknown."""
        return self.engine.loras is not None and self.engine.loras.remove(lora_name)

    def kv_events(self, epoch: str | None, seq: int) -> tuple[KVEventBatch, QueueLoad]:
        """What the prefix cache gained and lost since a router's cursor (kvcache/events.py),
        and the queued work as of now (requests waiting and running, prompt tokens owed:
        scheduler/queues.py's `load`). On the event loop, between scheduling calls."""
        scheduler = self.engine.scheduler
        return scheduler.kv.events.since(epoch, seq), scheduler.queues.load()

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.engine.shutdown()
