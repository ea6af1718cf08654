"""The Ray actor that hosts one tensor-parallel rank's Worker.

Its plans arrive on one thread, which calls `execute` (or `execute_lagged`) for each: the
host channel's (`serve_channel`: ranks on the engine's host, cluster/engine/host_channel.py)
or the compiled graph's loop (ranks elsewhere). `ping`,
`provide_bitmask` and the KV transfer's `export_kv` / `import_kv` arrive on the actor's
second thread. A grammar bitmask is only posted there: the step loop's thread takes it and
hands it to the worker (the Worker's steps run on one thread only). A KV transfer copies
blocks that no step in flight writes (the engine orders it: cluster/engine/kv_transfers.py),
so on CPU it runs beside a step. With `kv_transport: rdt` a prefill rank keeps its payload
on its device (`stash_kv`) until the decode rank's `import_kv_rdt` pulls it through `take_kv`
over Ray Direct Transport (cluster/engine/rdt_transport.py; Ray runs the send and receive on
the actor's `_ray_system` thread).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import ray
import torch

from cluster.engine.host_channel import RankEnd
from cluster.engine.kv_transport import KVTransferError, fetch, publish
from cluster.engine.rdt_transport import PayloadStash
from cluster.engine.wakeup import CallCounter, Park, WakeReader
from scheduler.plan import StepPlan, StepResult
from workers.config import WorkerConfig

# How long a step waits for its grammar bitmask before the worker gives up (the engine
# posts it within one step of launching the plan).
BITMASK_TIMEOUT_S = 120.0


@ray.remote(enable_tensor_transport=True)
class RayWorker:
    def __init__(self, config: WorkerConfig) -> None:
        from workers.worker import Worker

        self.worker = Worker(config)
        self._bitmasks: dict[int, np.ndarray] = {}
        self._posted = threading.Condition()
        self._wake: WakeReader | None = None
        self._calls: CallCounter | None = None  # the output rank's count of finished calls
        self._stash = PayloadStash()  # KV payloads waiting for an RDT pull

    def join(self) -> None:
        """Join the engine's process group (the rendezvous: every rank is called before any
        is waited on, and the executor bounds the wait)."""
        self.worker.init_distributed()

    def init(self) -> tuple[int, int, int]:
        """After `join`: load this rank's shard and report its KV block counts."""
        self.worker.load_model()
        return self.worker.determine_num_blocks()

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, num_offload_blocks: int) -> None:
        self.worker.init_cache(num_gpu_blocks, num_cpu_blocks, num_offload_blocks)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    def open_wake_socket(self, path: str, calls_path: str | None = None) -> None:
        """The socket this rank parks on and, on the output rank, the counter of its finished
        calls that the engine sleeps on (cluster/engine/wakeup.py)."""
        self._wake = WakeReader(path)
        if calls_path is not None:
            self._calls = CallCounter.attach(calls_path)

    def serve_channel(self, path: str, rank: int, num_ranks: int, slots: int, output: bool,
                      lagged: bool) -> int:
        """Map the engine's host channel and run every plan it sends, in order, on a thread of
        its own until the engine closes it (only the `output` rank's results go back); the
        process id, by which the engine tells a dead rank."""
        end = RankEnd(path, rank, num_ranks, slots)
        call = self.execute_lagged if lagged else self.execute
        threading.Thread(target=end.serve, args=(call, output), name="host-channel",
                         daemon=True).start()
        return os.getpid()

    def execute(self, plan: StepPlan | Park) -> StepResult | None:
        try:
            if isinstance(plan, Park):
                return self._park()
            self.worker.launch(plan)
            self._take_bitmask()
            return self.worker.collect(plan.step_id)[0]
        finally:
            if self._calls is not None:  # (a failed call too: its error is its output)
                self._calls.bump()

    def execute_lagged(self, plan: StepPlan | Park | None) -> StepResult | None:
        """Launch `plan`, return the result of the plan launched before it (Worker.execute_lagged)."""
        try:
            if isinstance(plan, Park):
                return self._park()
            self._take_bitmask()  # the last step must sample before this one can launch
            return self.worker.execute_lagged(plan)
        finally:
            if self._calls is not None:
                self._calls.bump()

    def _park(self) -> None:
        """Wait, without spinning, until the engine has work again (see cluster/engine/wakeup.py)."""
        if self._wake is None:
            raise RuntimeError("Park sent to a rank with no wake socket")
        self._wake.wait()

    def provide_bitmask(self, step_id: int, bitmask: np.ndarray) -> None:
        with self._posted:
            self._bitmasks[step_id] = bitmask
            self._posted.notify_all()

    def _take_bitmask(self) -> None:
        step_id = self.worker.awaiting_bitmask()
        if step_id is None:
            return
        with self._posted:
            if not self._posted.wait_for(lambda: step_id in self._bitmasks, BITMASK_TIMEOUT_S):
                raise RuntimeError(f"step {step_id}'s grammar bitmask did not arrive within "
                                   f"{BITMASK_TIMEOUT_S:.0f} s")
            bitmask = self._bitmasks.pop(step_id)
        self.worker.provide_bitmask(step_id, bitmask)

    def export_kv(self, block_ids: list[int]) -> tuple[list, int]:
        """This rank's payload of `block_ids`, put in the object store by this actor (its
        owner; in a list, so the caller gets the ref, not the tensor), and its bytes."""
        payload = self.worker.export_kv(block_ids)
        return [publish(payload)], payload.numel() * payload.element_size()

    def import_kv(self, block_ids: list[int], handles: list, first: int,
                  timeout_s: float) -> str | None:
        """Fetch `handles[0]` (a list: Ray would resolve a bare ref before the call, and a
        lost object would fail the actor call) and write it; why not, or None."""
        try:
            payload = fetch(handles[0], timeout_s)
        except KVTransferError as e:
            return str(e)
        self.worker.import_kv(block_ids, payload, first)
        return None

    def stash_kv(self, key: str, block_ids: list[int], ttl_s: float) -> int:
        """Keep this rank's payload of `block_ids` on its device under `key` for `ttl_s`
        seconds (or until taken); its bytes."""
        payload = self.worker.export_kv(block_ids, to_host=False)
        self._stash.put(key, payload, ttl_s)
        return payload.numel() * payload.element_size()

    def has_kv(self, key: str) -> bool:
        return self._stash.has(key)

    def take_kv(self, key: str) -> torch.Tensor:
        """The payload under `key`, handed over once (called with a tensor_transport: the
        tensor stays here until Ray sends it to the rank the ref is passed to)."""
        return self._stash.take(key)

    def import_kv_rdt(self, block_ids: list[int], payload: torch.Tensor, first: int,
                      deadline: float) -> str | None:
        """Write a payload Ray delivered over RDT, unless it came after `deadline` (wall
        clock: the engine may have given the blocks back by then); why not, or None."""
        if time.time() > deadline:
            return "the KV payload arrived after the transfer's bound"
        self.worker.import_kv(block_ids, payload, first)
        return None

    def ping(self) -> bool:
        return True


# A compiled graph runs its execution loop on the actor's `_ray_system` thread for the graph's
# life, and Ray Direct Transport runs its sends and receives there too; Ray 2.60 gives an actor
# with tensor transport one such thread (ray#54639), so RDT would wait forever behind the loop.
# A second one serves RDT (one transfer at a time per pair: cluster/engine/rdt_transport.py).
RayWorker.__ray_metadata__.concurrency_groups["_ray_system"] = 2
