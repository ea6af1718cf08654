"""`RayExecutor`: one Ray actor per rank (pipeline_parallel_size x tensor_parallel_size), in
one placement group per pipeline stage, one bundle per rank (stage_placement.py).

Per step the plan goes to every rank through a Ray Compiled Graph (shared-memory channels,
one write read by every rank; its cost against one actor call per rank is in
docs/benchmarks.md); `compiled_graph=False` falls back to one actor call per rank. With
`lagged` (async scheduling) each graph call launches its plan and returns the result of the
plan before. Idle ranks park on a socket (wakeup.py) instead of spinning on the channel.
The graph's blocking calls wait out a long step but not a dead rank (dag_calls.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
from collections import deque
from typing import Any, NoReturn

import numpy as np

from cluster.engine.dag_calls import DagCaller, dead_rank, ray_timeout_s
from cluster.engine.executor import Executor, WorkerDiedError
from cluster.engine.kv_transport import KVTransferError
from cluster.engine.rdt_transport import RDTHandle, RDTPeers, new_key
from cluster.engine.stage_placement import place_stages
from cluster.engine.wakeup import Park, WakeSockets
from scheduler.plan import StepPlan, StepResult
from workers.config import WorkerConfig
from workers.distributed import get_free_port

# Environment the worker processes need to behave like this one (offline hub, shared cache).
_FORWARDED_ENV = ("HF_HUB_OFFLINE", "QWEN3_SERVE_CACHE", "TOKENIZERS_PARALLELISM",
                  "TRITON_INTERPRET", "CUDA_LAUNCH_BLOCKING", "OMP_WAIT_POLICY")


def worker_env(device: str) -> dict[str, str]:
    """The environment variables a worker actor starts with: _FORWARDED_ENV as set here, and on
    a CPU OpenMP threads that sleep when idle (OMP_WAIT_POLICY=PASSIVE unless set). With the
    default active wait, a host that deschedules one of torch's spinning threads stalls every
    parallel region on it, and a CPU worker's steps slow down 5-15x at random
    (docs/benchmarks.md, Step loop). It must be in the environment when the process starts:
    OpenMP reads it once, when torch loads it."""
    env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    if device == "cpu":
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


class RayExecutor(Executor):
    """pp x tp worker actors; rank i in its stage's placement group (stage 0: from
    `bundle_offset` of the replica's, when it has one).

    Invariant: every rank receives every plan, in order; only the output rank's reply
    carries tokens (rank 0; with pipeline parallelism the last stage's first).
    A step completes when all ranks reply. If any rank fails, every rank is stopped and
    WorkerDiedError raised; `rebuild()` then starts a fresh set in the same bundles (the
    engine's recovery), or `shutdown()` ends the executor.
    """

    def __init__(self, config: WorkerConfig, *, num_cpus: float, use_gpu: bool,
                 placement_group: Any = None, bundle_offset: int = 0,
                 compiled_graph: bool = True, lagged: bool = False,
                 rdt_backend: str | None = None, kv_ttl_s: float = 10.0) -> None:
        bundle = {"GPU": 1, "CPU": num_cpus} if use_gpu else {"CPU": num_cpus}
        # One STRICT_PACK group per pipeline stage (stage_placement.py)
        self._placement = place_stages(config.pipeline_parallel_size,
                                       config.tensor_parallel_size, bundle, placement_group,
                                       bundle_offset)
        self._output_rank = config.output_rank  # whose reply carries the tokens
        self._config = config
        self._actor_options = dict(num_cpus=num_cpus, num_gpus=1 if use_gpu else 0)
        self._compiled_graph = compiled_graph
        # Lagged (async scheduling on a compiled graph): each call launches its plan and
        # returns the result of the plan launched by the call before, so the workers start
        # plan N+1 before handing back N's tokens.
        self._lagged = lagged and compiled_graph
        self.workers: list = []
        self._dag: Any = None
        self._caller: DagCaller | None = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._wake_sockets: WakeSockets | None = None
        # KV transfers over Ray Direct Transport (rdt_transport.py), else the object store;
        # a payload this executor exports waits kv_ttl_s to be pulled.
        self._rdt = RDTPeers(rdt_backend) if rdt_backend else None
        self._kv_ttl_s = kv_ttl_s
        self._start(None)

    def _start(self, blocks: tuple[int, int, int] | None) -> None:
        """Actors for every rank, loaded, with caches of `blocks` (GPU, CPU) blocks (None:
        the most every rank can hold), a compiled graph and wake sockets."""
        from cluster.engine.ray_worker import RayWorker

        env = worker_env(self._config.device)
        self._dead: str | None = None
        self.workers = []
        for rank in range(self._config.world_size):
            cfg = dataclasses.replace(self._config, rank=rank)
            # Two threads: the compiled graph's loop holds one, health pings use the other.
            actor = RayWorker.options(
                **self._actor_options, max_concurrency=2, runtime_env={"env_vars": env},
                scheduling_strategy=self._placement.strategy(rank),
            ).remote(cfg)
            self.workers.append(actor)
        # Rendezvous happens inside init: all ranks must be called before any is waited on.
        held = self._wait_all([w.init.remote() for w in self.workers])
        gpu, cpu, tier = (min(b[i] for b in held) for i in range(3))
        if blocks is not None:
            if min(gpu - blocks[0], cpu - blocks[1], tier - blocks[2]) < 0:
                self._fail(RuntimeError(f"the new ranks hold {gpu}/{cpu}/{tier} GPU/CPU/offload KV "
                                        f"blocks, fewer than the {blocks} before"))
            gpu, cpu, tier = blocks
        self.num_gpu_blocks, self.num_cpu_blocks, self.num_offload_blocks = gpu, cpu, tier
        self._wait_all([w.init_cache.remote(gpu, cpu, tier) for w in self.workers])
        # (DAG output ref futures, oldest first, each with the step whose result it carries:
        # None for a call that followed none.)
        self._outputs: deque[tuple[int | None, concurrent.futures.Future]] = deque()
        self._last_launched: int | None = None
        self._calls: dict[int, concurrent.futures.Future] = {}  # not lagged: step -> call
        self._bitmask_refs: list = []
        # Parking (cluster/engine/wakeup.py): sockets when every rank shares this process's host; the
        # Park call's output while parked; not lagged, park outputs the next read must skip.
        self._wake_sockets = self._open_wake_sockets() if self._compiled_graph else None
        self._parked: concurrent.futures.Future | None = None
        self._unread_parks: deque[concurrent.futures.Future] = deque()
        if self._compiled_graph:
            self._caller = DagCaller(functools.partial(dead_rank, list(self.workers)))
        self._dag = self._compile() if self._compiled_graph else None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dag")

    def rebuild(self) -> None:
        """After a rank died: new actors for every rank in the same bundles, weights reloaded,
        empty KV caches of the sizes the engine's scheduler already has. StagesUnplacedError
        when a lost stage's group finds no node with room (stage_placement.wait_placed)."""
        self._stop()
        self._placement.wait_placed()
        if self._config.world_size > 1:  # a fresh rendezvous port
            self._config = dataclasses.replace(
                self._config, dist_init_method=f"tcp://127.0.0.1:{get_free_port()}")
        self._start((self.num_gpu_blocks, self.num_cpu_blocks, self.num_offload_blocks))

    def _open_wake_sockets(self) -> WakeSockets | None:
        import ray

        here = ray.get_runtime_context().get_node_id()
        if any(n != here for n in self._wait_all([w.node_id.remote() for w in self.workers])):
            return None  # ranks on another host: they spin when idle (no socket reaches them)
        sockets = WakeSockets(len(self.workers))
        self._wait_all([w.open_wake_socket.remote(p) for w, p in zip(self.workers, sockets.paths)])
        return sockets

    def park(self) -> None:
        if self._wake_sockets is None or self._parked is not None or self._dead is not None:
            return
        self._parked = self._thread.submit(self._dag_submit, Park())

    def _unpark(self) -> None:
        """Wake the parked ranks; the Park call's output is read in order, later."""
        parked, self._parked = self._parked, None
        if parked is None:
            return
        self._wake_sockets.wake()
        if self._lagged:
            self._outputs.append((None, parked))
        else:
            self._unread_parks.append(parked)

    def _compile(self) -> Any:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as plan:
            dag = MultiOutputNode([(w.execute_lagged if self._lagged else w.execute).bind(plan)
                                   for w in self.workers])
        # (reads get the same timeout in _dag_get: dag_calls.py bounds a step, not Ray)
        return dag.experimental_compile(_submit_timeout=ray_timeout_s())

    def _wait_all(self, refs: list) -> list:
        """ray.get of every ref, failing as soon as ANY fails: a dead rank leaves the others
        blocked in a collective, so waiting on rank 0 alone could hang."""
        import ray

        self.check_health()
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready)
            except Exception as e:  # noqa: BLE001 — any worker failure ends the executor
                self._fail(e)
        return ray.get(refs)

    def _fail(self, error: BaseException) -> NoReturn:
        self._dead = f"a tensor-parallel worker failed: {type(error).__name__}: {error}"
        self._stop()
        raise WorkerDiedError(self._dead) from error

    def submit(self, plan: StepPlan) -> int:
        """Every call on the compiled graph happens on `_thread` (the graph is not
        thread-safe), in order: a plan submitted while the previous one runs is written to
        the graph's input channel at once, so the workers start it the moment they finish.
        The handle is the plan's step id."""
        self.check_health()
        self._unpark()
        if self._lagged:
            self._outputs.append((self._last_launched,
                                  self._thread.submit(self._dag_submit, plan)))
            self._last_launched = plan.step_id
        elif self._dag is None:  # one actor call per rank, each plan after the last returned
            self._calls[plan.step_id] = self._thread.submit(self._call_all, plan)
        else:
            self._calls[plan.step_id] = self._thread.submit(self._dag_submit, plan)
        return plan.step_id

    def result(self, handle: int) -> concurrent.futures.Future:
        self.check_health()
        if not self._lagged:
            call = self._calls.pop(handle)
            return call if self._dag is None else self._thread.submit(self._dag_get, call)
        if not any(step == handle for step, _ in self._outputs):
            # Nothing launched after it: a call with no plan brings its result back.
            self._outputs.append((self._last_launched,
                                  self._thread.submit(self._dag_submit, None)))
            self._last_launched = None
        return self._thread.submit(self._read_lagged, handle)

    def _read_lagged(self, step_id: int) -> StepResult:
        """Read the DAG's outputs in order up to the one carrying `step_id`'s result."""
        while True:
            step, submitted = self._outputs.popleft()
            result = self._dag_get(submitted)
            if step == step_id:
                return result

    def provide_bitmask(self, handle: int, bitmask: np.ndarray) -> None:
        """The output rank (rank 0 unless pipeline-parallel) takes it on its second thread;
        its step loop samples once it is there."""
        import ray

        if self._bitmask_refs:  # the earlier hand-overs that are done: did they fail?
            done, self._bitmask_refs = ray.wait(self._bitmask_refs, timeout=0,
                                                num_returns=len(self._bitmask_refs))
            try:
                ray.get(done)
            except Exception as e:  # noqa: BLE001 — any worker failure ends the executor
                self._fail(e)
        self._bitmask_refs.append(
            self.workers[self._output_rank].provide_bitmask.remote(handle, bitmask))

    def _call_all(self, plan: StepPlan) -> StepResult:
        result = self._wait_all([w.execute.remote(plan) for w in self.workers])
        self.rebuilds_without_step = 0
        return result[self._output_rank]

    def _dag_submit(self, plan: StepPlan) -> Any:
        self.check_health()
        try:
            return self._caller.call(self._dag.execute, plan)
        except Exception as e:  # noqa: BLE001 — any worker failure ends the executor
            self._fail(e)

    def _dag_get(self, submitted: concurrent.futures.Future) -> StepResult:
        import ray

        while self._unread_parks and self._unread_parks[0] is not submitted:
            self._dag_get(self._unread_parks.popleft())  # (None: a parked call's output)
        ref = submitted.result()  # done: submitted earlier on this same thread
        try:
            # A dead rank raises here within a slice (dag_calls.py); a long step is waited for.
            outputs = self._caller.call(lambda: ray.get(ref, timeout=ray_timeout_s()))
        except Exception as e:  # noqa: BLE001 — any worker failure ends the executor
            self._fail(e)
        result = outputs[self._output_rank]
        if result is None:  # (a Park's output, or a lagged call's that followed none)
            return None
        self.rebuilds_without_step = 0
        return result.owned()  # (copied out of the channel's buffer: see StepResult.owned)

    def export_kv(self, block_ids: list[int]) -> tuple[list, int]:
        if self._rdt is not None:
            key = new_key()
            sizes = self._wait_all([w.stash_kv.remote(key, block_ids, self._kv_ttl_s)
                                    for w in self.workers])
            return [RDTHandle(w, key, self._rdt.backend) for w in self.workers], sum(sizes)
        out = self._wait_all([w.export_kv.remote(block_ids) for w in self.workers])
        return [refs[0] for refs, _ in out], sum(n for _, n in out)

    def import_kv(self, block_ids: list[int], handles: list, first: int,
                  timeout_s: float) -> None:
        self.check_health()
        if self._rdt is not None:
            try:
                errors = self._rdt.import_kv(self.workers, handles, block_ids, first, timeout_s)
            except KVTransferError:
                raise
            except Exception as e:  # noqa: BLE001 — a decode rank failed: the executor is done
                self._fail(e)
        else:
            errors = self._wait_all([w.import_kv.remote(block_ids, [h], first, timeout_s)
                                     for w, h in zip(self.workers, handles)])
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise KVTransferError(failed)

    def check_health(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)

    def ping(self, timeout: float = 5.0) -> None:
        """Probe every rank between steps: a rank that died while idle is found here.

        A rank still busy after `timeout` (a long step) is not judged; its step will tell.
        """
        import ray

        self.check_health()
        refs = [w.ping.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        try:
            ray.get(ready)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _stop(self) -> None:
        """Stop every rank and the graph (best effort: this also runs after a rank died)."""
        import ray

        if self._rdt is not None:  # (the pairs with this group's ranks end with them)
            with contextlib.suppress(Exception):
                self._rdt.close()
        # Parked ranks wake first, so their loops can see the teardown.
        with contextlib.suppress(Exception):
            self._unpark()
        # A clean stop tears the compiled graph down first, while its actors live: that
        # cancels their execution loops cleanly (killed first, each cancel fails with
        # ActorDiedError). After a rank died the live ranks are killed first: a teardown that
        # closes a channel on one node while a rank on another still pushes into it can crash
        # that node's raylet (Ray 2.60, experimental_mutable_object_provider.cc "Channel
        # closed"; seen when a stage's node was lost), taking a second node with the first.
        dag, self._dag = self._dag, None
        kill_first = self._dead is not None
        if not kill_first and dag is not None:
            with contextlib.suppress(Exception):  # a dead worker: its loop is gone already
                dag.teardown()
        for w in self.workers:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(w, no_restart=True)
        if kill_first and dag is not None:
            with contextlib.suppress(Exception):  # (its actors are gone: this frees the driver's side)
                dag.teardown()
        self.workers = []
        caller, self._caller = self._caller, None
        if caller is not None:
            caller.close()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=False)
        sockets, self._wake_sockets = self._wake_sockets, None
        if sockets is not None:
            sockets.close()

    def shutdown(self) -> None:
        self._stop()
        self._placement.remove()
