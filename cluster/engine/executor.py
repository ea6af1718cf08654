"""Executors: run a StepPlan on every tensor-parallel rank and return rank 0's StepResult.

`Executor` is the interface the engine steps through; `InProcessExecutor` (here) runs tp = 1
in this process (tests, benchmarks, and a Serve replica with tp = 1, where it saves a process
hop per step); `RayExecutor` (ray_executor.py) runs one Ray actor per rank.
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from cluster.engine.kv_transport import fetch, publish
from scheduler.plan import StepPlan, StepResult
from workers.config import WorkerConfig


def plans_in_flight(pipeline_parallel_size: int, async_scheduling: bool) -> int:
    """How many plans the engine keeps submitted ahead of the oldest one's result: one (two
    with async scheduling) on a single stage; at pp > 1 one per stage, of disjoint sequences
    (scheduler/ahead.py's micro-batches), with async scheduling or not. Async scheduling's
    plan ahead names tokens the plan before samples (PENDING_TOKEN), which the first stage
    could embed only once the last stage had sampled them: it would wait on every plan, so
    at pp > 1 the micro-batches are how scheduling runs ahead of results."""
    if pipeline_parallel_size > 1:
        return pipeline_parallel_size
    return 2 if async_scheduling else 1


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone; the engine cannot continue."""


class Executor(ABC):
    """Interface: sized KV cache after construction, then plans, in order.

    `submit(plan)` starts a plan without waiting for it and returns a handle;
    `result(handle)` is a future of its StepResult (rank 0's). With async scheduling the
    engine submits step N+1 before it asks for step N's result, so the workers run N+1 while
    the engine handles N. Plans run on the workers in submission order, and results must be
    asked for in that order too. A plan with constrained rows samples once
    `provide_bitmask(handle, bitmask)` gives rank 0 their grammar bitmask. `execute` is
    submit and result at once.
    """

    num_gpu_blocks: int
    num_cpu_blocks: int
    num_offload_blocks: int = 0  # per rank: the CPU tier of evicted prefix blocks
    # Rebuilds since the workers last returned a step's result: engine_setup.rebuild_or_raise
    # counts them, the executor zeroes them. A rebuilt group that fails again before finishing
    # a step (the step that killed the last one, run again) has used one more attempt.
    rebuilds_without_step: int = 0

    @abstractmethod
    def submit(self, plan: StepPlan) -> Any:
        """Start `plan` on every rank; a handle for `result`."""

    @abstractmethod
    def result(self, handle: Any) -> concurrent.futures.Future:
        """A future of the submitted plan's StepResult (rank 0's)."""

    @abstractmethod
    def provide_bitmask(self, handle: Any, bitmask: np.ndarray) -> None:
        """The grammar bitmask of a submitted plan's constrained rows (see scheduler.plan)."""

    def execute(self, plan: StepPlan) -> StepResult:
        """Run `plan` on every rank; rank 0's result."""
        return self.result(self.submit(plan)).result()

    def export_kv(self, block_ids: list[int]) -> tuple[list[Any], int]:
        """Every rank packs its KV of `block_ids` (workers/kv_transfer.py) and publishes it
        (cluster/engine/kv_transport.py); the handles, rank by rank, and the payloads' bytes
        together. The caller holds the blocks until this returns: the copy is out then."""
        raise ValueError(f"{type(self).__name__} does not transfer KV blocks")

    def import_kv(self, block_ids: list[int], handles: list[Any], first: int,
                  timeout_s: float) -> None:
        """Rank r fetches `handles[r]` and writes its blocks `first ..` into `block_ids`;
        KVTransferError when a payload is not had within `timeout_s`. Called with no plan
        in flight (nothing else reads or writes those blocks meanwhile)."""
        raise ValueError(f"{type(self).__name__} does not transfer KV blocks")

    # Whether `write_kv` may run on any thread while steps run (InProcessExecutor on CPU).
    writes_kv_beside_steps: bool = False

    def write_kv(self, block_ids: list[int], payloads: list[Any], first: int) -> None:
        """Write fetched payloads (rank r's: `payloads[r]`) into blocks `first ..` of
        `block_ids`, on the caller's thread, while steps run: only into blocks that no plan
        submitted before it returns reads or writes (`writes_kv_beside_steps`)."""
        raise ValueError(f"{type(self).__name__} does not write KV blocks beside its steps")

    def park(self) -> None:  # noqa: B027 — a real default
        """Nothing is in flight and nothing will be for a while: let the workers wait without
        burning a core (a Ray compiled graph's ranks otherwise spin). The next submit wakes
        them. In-process, there is no one to park."""

    def ping(self, timeout: float = 5.0) -> None:  # noqa: B027 — a real default
        """Probe the workers between steps (raise WorkerDiedError for a dead one); an
        in-process worker has nothing to probe."""

    def check_health(self) -> None:  # noqa: B027 — a real default, not a missing override
        """Raise WorkerDiedError when a worker is gone. An in-process worker cannot die
        apart from this process, so by default there is nothing to check."""

    def rebuild(self) -> None:
        """Start the workers afresh after WorkerDiedError (empty KV caches of the same size);
        raise when that is impossible (an in-process worker dies with its process)."""
        raise WorkerDiedError("an in-process worker cannot be rebuilt")

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers; the executor is unusable afterwards."""


class _Collect(concurrent.futures.Future):
    """The future of an in-process step: `result()` collects it from the worker (on CUDA
    that waits for the step's sampled ids; on CPU they are there already)."""

    def __init__(self, worker: Any, step_id: int) -> None:
        super().__init__()
        self._worker, self._step_id = worker, step_id

    def done(self) -> bool:
        """Whether `result()` would return without waiting."""
        return super().done() or self._worker.step_ready(self._step_id)

    def result(self, timeout: float | None = None) -> StepResult:
        if not super().done():
            try:
                self.set_result(self._worker.collect(self._step_id)[0])
            except BaseException as e:  # noqa: BLE001 — handed to whoever waits on it
                self.set_exception(e)
        return super().result(timeout)


class InProcessExecutor(Executor):
    """tp = 1 in this process. On CUDA on the caller's thread: a submit only enqueues work on
    the GPU and returns, so no helper thread is needed to overlap steps. On CPU the forward
    pass is the submit, so every call into the worker runs on one helper thread, in order: the
    caller (a Serve replica's event loop) stays free to stream the last step's tokens while
    torch computes this one (on the loop itself, a step's chunks went out in bursts: ITL p50
    1.4 ms, p99 3.2 s, docs/benchmarks.md, issue #43). Only that thread touches the worker
    while a step is in flight, apart from `write_kv`'s copy into blocks no plan uses."""

    def __init__(self, config: WorkerConfig) -> None:
        from workers.worker import Worker

        self.worker = Worker(config)
        try:
            self.worker.init_distributed()
            self.worker.load_model()
            self.num_gpu_blocks, self.num_cpu_blocks, self.num_offload_blocks = \
                self.worker.determine_num_blocks()
            self.worker.init_cache(self.num_gpu_blocks, self.num_cpu_blocks,
                                   self.num_offload_blocks)
        except BaseException:
            # (the error's traceback keeps the worker: without this its model and KV cache
            # stay on the device for as long as the error is kept, e.g. by a test runner)
            self.worker.shutdown()
            raise
        self._thread = (concurrent.futures.ThreadPoolExecutor(1, "inprocess-worker")
                        if config.device == "cpu" else None)
        self._launches: dict[int, concurrent.futures.Future] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        return self.result(self.submit(plan)).result()

    def submit(self, plan: StepPlan) -> int:
        if self._thread is None:
            self.worker.launch(plan)
        else:
            self._launches[plan.step_id] = self._thread.submit(self.worker.launch, plan)
        return plan.step_id

    def result(self, handle: int) -> concurrent.futures.Future:
        if self._thread is None:
            return _Collect(self.worker, handle)
        return self._thread.submit(self._collect, self._launches.pop(handle), handle)

    def _collect(self, launch: concurrent.futures.Future, step_id: int) -> StepResult:
        launch.result()  # (a plan the worker refused raises here)
        result = self.worker.collect(step_id)[0]
        assert result is not None  # rank 0 always answers
        return result

    def provide_bitmask(self, handle: int, bitmask: np.ndarray) -> None:
        if self._thread is None:
            self.worker.provide_bitmask(handle, bitmask)
        else:
            self._thread.submit(self.worker.provide_bitmask, handle, bitmask).result()

    def export_kv(self, block_ids: list[int]) -> tuple[list[Any], int]:
        payload = self._on_worker(self.worker.export_kv, block_ids)
        return [publish(payload)], payload.numel() * payload.element_size()

    def import_kv(self, block_ids: list[int], handles: list[Any], first: int,
                  timeout_s: float) -> None:
        payload = fetch(handles[0], timeout_s)
        self._on_worker(self.worker.import_kv, block_ids, payload, first)

    @property
    def writes_kv_beside_steps(self) -> bool:  # type: ignore[override]
        """On CPU: the worker's steps run on their own thread, and a payload's write into
        blocks no plan uses is a host copy that touches nothing a step does."""
        return self._thread is not None

    def write_kv(self, block_ids: list[int], payloads: list[Any], first: int) -> None:
        self.worker.import_kv(block_ids, payloads[0], first)

    def _on_worker(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` where the worker's steps run, after every step submitted so far."""
        return fn(*args) if self._thread is None else self._thread.submit(fn, *args).result()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        self.worker.shutdown()
