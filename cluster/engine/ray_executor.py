"""`RayExecutor`: one Ray actor per rank (pipeline_parallel_size x tensor_parallel_size), in
one placement group per pipeline stage, one bundle per rank (stage_placement.py). This module
owns a group's life (start, rebuild, failure, stop) and the KV transfers; how each call reaches
the ranks and comes back is its base class's, `PlanCalls` (plan_calls.py).

Per step the plan goes to every rank in one write that every rank reads: through the host
channel (host_channel.py: one shared-memory segment, futex wake-ups, written on the caller's
thread) when every rank runs on the engine's host, as a Serve replica's STRICT_PACK group
does; else through a Ray Compiled Graph (its cost against one actor call per rank is in
docs/benchmarks.md). `compiled_graph=False` falls back to one actor call per rank. With
`lagged` (async scheduling) each call launches its plan and returns the result of the plan
before. A channel's idle ranks sleep on it; a graph's park on a socket (wakeup.py) instead of
spinning on its channel, and the engine sleeps on the output rank's count of finished calls
before it reads an output. Either way a long step is waited out, up to STEP_BOUND_S, but not a
dead rank (dag_calls.py; the channel checks the ranks' processes between its sleeps).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import time
from typing import Any, NoReturn

import numpy as np

from cluster.engine import host_channel
from cluster.engine.dag_calls import DagCaller, dead_rank
from cluster.engine.executor import Executor, WorkerDiedError
from cluster.engine.kv_transport import KVTransferError
from cluster.engine.plan_calls import PlanCalls
from cluster.engine.rank_group import RankGroup
from cluster.engine.rdt_transport import RDTHandle, RDTPeers, new_key
from cluster.engine.stage_placement import place_stages
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


# The longest the ranks of a new group may take to meet at their rendezvous (actors started,
# torch.distributed joined; weights are loaded after it). A rank that never arrives (killed,
# or starved of CPU) then fails that start attempt instead of holding it for the process
# group's own 10-minute init timeout (workers/distributed.py).
JOIN_TIMEOUT_S = 120.0


class RayExecutor(PlanCalls, Executor):
    """pp x tp worker actors; rank i in its stage's placement group (stage 0: from
    `bundle_offset` of the replica's, when it has one).

    Invariant: every rank receives every plan, in order; only the output rank's reply
    carries tokens (rank 0; with pipeline parallelism the last stage's first).
    A step completes when all ranks reply. If any rank fails, every rank of its group is
    stopped and WorkerDiedError raised; `rebuild()` then starts a fresh group in the same
    bundles (the engine's recovery), or `shutdown()` ends the executor.
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
        self._g: RankGroup | None = None  # the current group of ranks
        # KV transfers over Ray Direct Transport (rdt_transport.py), else the object store;
        # a payload this executor exports waits kv_ttl_s to be pulled.
        self._rdt = RDTPeers(rdt_backend) if rdt_backend else None
        self._kv_ttl_s = kv_ttl_s
        self._start(None)

    @property
    def workers(self) -> list:
        """The current group's rank actors, in rank order (empty once it is stopped)."""
        g = self._g
        return [] if g is None or g.stopped else list(g.workers)

    def _start(self, blocks: tuple[int, int, int] | None) -> None:
        """A new group: actors for every rank, joined, loaded, with caches of `blocks` (GPU,
        CPU, offload) blocks (None: the most every rank can hold), a compiled graph and wake
        sockets. It is the executor's group from its first actor on, so a failure below stops
        it and the next rebuild starts from a stopped group."""
        from cluster.engine.ray_worker import RayWorker

        env = worker_env(self._config.device)
        workers = []
        for rank in range(self._config.world_size):
            cfg = dataclasses.replace(self._config, rank=rank)
            # Two threads: the compiled graph's loop holds one, health pings use the other.
            workers.append(RayWorker.options(
                **self._actor_options, max_concurrency=2, runtime_env={"env_vars": env},
                scheduling_strategy=self._placement.strategy(rank),
            ).remote(cfg))
        g = RankGroup(workers, concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dag"))
        self._g = g
        # The rendezvous happens inside join: all ranks are called before any is waited on.
        self._wait_all(g, [w.join.remote() for w in workers], timeout_s=JOIN_TIMEOUT_S,
                       what="join their process group")
        held = self._wait_all(g, [w.init.remote() for w in workers])
        gpu, cpu, tier = (min(b[i] for b in held) for i in range(3))
        if blocks is not None:
            if min(gpu - blocks[0], cpu - blocks[1], tier - blocks[2]) < 0:
                self._fail(g, RuntimeError(
                    f"the new ranks hold {gpu}/{cpu}/{tier} GPU/CPU/offload KV blocks, fewer "
                    f"than the {blocks} before"))
            gpu, cpu, tier = blocks
        self.num_gpu_blocks, self.num_cpu_blocks, self.num_offload_blocks = gpu, cpu, tier
        self._wait_all(g, [w.init_cache.remote(gpu, cpu, tier) for w in workers])
        if self._compiled_graph:
            import ray

            here = ray.get_runtime_context().get_node_id()
            nodes = self._wait_all(g, [w.node_id.remote() for w in workers])
            # Ray 2.60's cross-node channels: a compiled graph with two calls in flight whose
            # driver shares no node with any rank (an offline driver on a head node with its
            # ranks elsewhere) now and then hangs, the driver and every rank blocked in a
            # channel read (seen in tests/cluster/multinode/test_pipeline.py). Such a driver
            # makes one call at a time; a Serve replica's stage 0 runs beside it.
            if set(nodes) == {here} and host_channel.enabled():
                g.channel = self._open_channel(g)
                if g.channel is not None:
                    return
            g.serial = here not in nodes
            g.sockets = self._open_wake_sockets(g) if set(nodes) == {here} else None
            g.caller = DagCaller(functools.partial(dead_rank, list(workers)))
            g.dag = self._compile(g)

    def rebuild(self) -> None:
        """After a rank died: a new group of actors for every rank in the same bundles,
        weights reloaded, empty KV caches of the sizes the engine's scheduler already has.
        StagesUnplacedError when a lost stage's group finds no node with room
        (stage_placement.wait_placed)."""
        self._stop(self._g)
        self._placement.wait_placed()
        if self._config.world_size > 1:  # a fresh rendezvous port
            self._config = dataclasses.replace(
                self._config, dist_init_method=f"tcp://127.0.0.1:{get_free_port()}")
        self._start((self.num_gpu_blocks, self.num_cpu_blocks, self.num_offload_blocks))

    def _wait_all(self, g: RankGroup, refs: list, timeout_s: float | None = None,
                  what: str = "answer") -> list:
        """ray.get of every ref, failing as soon as ANY fails (a dead rank leaves the others
        blocked in a collective, so waiting on rank 0 alone could hang), or when `timeout_s`
        passes first."""
        import ray

        self._check(g)
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._fail(g, TimeoutError(f"{len(pending)} of {len(refs)} ranks did not "
                                           f"{what} within {timeout_s:g} s"))
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            try:
                ray.get(ready)
            except Exception as e:  # noqa: BLE001 — any worker failure ends the group
                self._fail(g, e)
        return ray.get(refs)

    def _fail(self, g: RankGroup, error: BaseException) -> NoReturn:
        with g.lock:
            if g.dead is None:
                g.dead = f"a tensor-parallel worker failed: {type(error).__name__}: {error}"
        self._stop(g)
        raise WorkerDiedError(g.dead) from error

    def submit(self, plan: StepPlan) -> int:
        """Every call on the compiled graph happens on the group's thread (the graph is not
        thread-safe), in order: a plan submitted while the previous one runs is written to
        the graph's input channel at once, so the workers start it the moment they finish.
        The handle is the plan's step id."""
        g = self._g
        self._check(g)
        self._unpark(g)
        if self._lagged:
            g.outputs.append((g.last_launched, self._submit_call(g, plan)))
            g.last_launched = plan.step_id
        elif g.dag is None and g.channel is None:  # one actor call per rank, in turn
            g.calls[plan.step_id] = self._on_thread(g, self._call_all, g, plan)
        else:
            g.calls[plan.step_id] = self._submit_call(g, plan)
        return plan.step_id

    def result(self, handle: int) -> concurrent.futures.Future:
        g = self._g
        self._check(g)
        if not self._lagged:
            call = g.calls.pop(handle)
            if g.dag is None and g.channel is None:
                return call
            return self._on_thread(g, self._dag_get, g, call)
        if not any(step == handle for step, _ in g.outputs):
            # Nothing launched after it: a call with no plan brings its result back.
            g.outputs.append((g.last_launched, self._submit_call(g, None)))
            g.last_launched = None
        return self._on_thread(g, self._read_lagged, g, handle)

    def provide_bitmask(self, handle: int, bitmask: np.ndarray) -> None:
        """The output rank (rank 0 unless pipeline-parallel) takes it on its second thread;
        its step loop samples once it is there."""
        import ray

        g = self._g
        if g.bitmask_refs:  # the earlier hand-overs that are done: did they fail?
            done, g.bitmask_refs = ray.wait(g.bitmask_refs, timeout=0,
                                            num_returns=len(g.bitmask_refs))
            try:
                ray.get(done)
            except Exception as e:  # noqa: BLE001 — any worker failure ends the group
                self._fail(g, e)
        g.bitmask_refs.append(g.workers[self._output_rank].provide_bitmask.remote(handle, bitmask))

    def _call_all(self, g: RankGroup, plan: StepPlan) -> StepResult:
        result = self._wait_all(g, [w.execute.remote(plan) for w in g.workers])
        self.rebuilds_without_step = 0
        return result[self._output_rank]

    def export_kv(self, block_ids: list[int]) -> tuple[list, int]:
        g = self._g
        if self._rdt is not None:
            key = new_key()
            sizes = self._wait_all(g, [w.stash_kv.remote(key, block_ids, self._kv_ttl_s)
                                       for w in g.workers])
            return [RDTHandle(w, key, self._rdt.backend) for w in g.workers], sum(sizes)
        out = self._wait_all(g, [w.export_kv.remote(block_ids) for w in g.workers])
        return [refs[0] for refs, _ in out], sum(n for _, n in out)

    def import_kv(self, block_ids: list[int], handles: list, first: int,
                  timeout_s: float) -> None:
        g = self._g
        self._check(g)
        if self._rdt is not None:
            try:
                errors = self._rdt.import_kv(g.workers, handles, block_ids, first, timeout_s)
            except KVTransferError:
                raise
            except Exception as e:  # noqa: BLE001 — a decode rank failed: the group is done
                self._fail(g, e)
        else:
            errors = self._wait_all(g, [w.import_kv.remote(block_ids, [h], first, timeout_s)
                                        for w, h in zip(g.workers, handles)])
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise KVTransferError(failed)

    def check_health(self) -> None:
        g = self._g
        if g is not None and g.dead is not None:
            raise WorkerDiedError(g.dead)

    def ping(self, timeout: float = 5.0) -> None:
        """Probe every rank between steps: a rank that died while idle is found here.

        A rank still busy after `timeout` (a long step) is not judged; its step will tell.
        """
        import ray

        g = self._g
        self._check(g)
        refs = [w.ping.remote() for w in g.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        try:
            ray.get(ready)
        except Exception as e:  # noqa: BLE001
            self._fail(g, e)

    def _stop(self, g: RankGroup | None) -> None:
        """Stop every rank of `g` and its graph, once (best effort: this also runs after a
        rank died). A second caller waits until the first has finished, so a rebuild never
        starts new ranks beside an old group still being torn down."""
        import ray

        if g is None:
            return
        with g.lock:
            if g.stopped:
                return
            if self._rdt is not None:  # (the pairs with this group's ranks end with them)
                with contextlib.suppress(Exception):
                    self._rdt.close()
            # Parked ranks wake first, so their loops can see the teardown.
            with contextlib.suppress(Exception):
                self._unpark(g)
            # A clean stop tears the compiled graph down first, while its actors live: that
            # cancels their execution loops cleanly (killed first, each cancel fails with
            # ActorDiedError). After a rank died the live ranks are killed first: a teardown
            # that closes a channel on one node while a rank on another still pushes into it
            # can crash that node's raylet (Ray 2.60, experimental_mutable_object_provider.cc
            # "Channel closed"; seen when a stage's node was lost), taking a second node with
            # the first.
            if g.channel is not None:  # (the ranks' loops end; a dead one's already did)
                g.channel.close()
            kill_first = g.dead is not None
            if not kill_first and g.dag is not None:
                with contextlib.suppress(Exception):  # a dead worker: its loop is gone already
                    g.dag.teardown()
            for w in g.workers:
                with contextlib.suppress(Exception):  # already gone
                    ray.kill(w, no_restart=True)
            if kill_first and g.dag is not None:
                with contextlib.suppress(Exception):  # (its actors are gone: frees the driver's side)
                    g.dag.teardown()
            if g.caller is not None:
                g.caller.close()
            g.thread.shutdown(wait=False)  # (queued calls run, find `stopped` and raise)
            if g.sockets is not None:
                g.sockets.close()
            if g.finished is not None:
                g.finished.unlink()
            g.stopped = True

    def shutdown(self) -> None:
        self._stop(self._g)
        self._placement.remove()
