"""The Ray actor that hosts one tensor-parallel rank's Worker.

The compiled graph's loop calls `execute` (or `execute_lagged`) on one thread; `ping`,
`provide_bitmask` and the KV transfer's `export_kv` / `import_kv` arrive on the actor's
second thread. A grammar bitmask is only posted there: the step loop's thread takes it and
hands it to the worker (the Worker's steps run on one thread only). A KV transfer copies
blocks that no step in flight writes (the engine orders it: cluster/engine/kv_transfers.py),
so on CPU it runs beside a step.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import ray

from cluster.engine.kv_transport import KVTransferError, fetch, publish
from cluster.engine.wakeup import Park, WakeReader
from scheduler.plan import StepPlan, StepResult
from workers.config import WorkerConfig

# How long a step waits for its grammar bitmask before the worker gives up (the engine
# posts it within one step of launching the plan).
BITMASK_TIMEOUT_S = 120.0


@ray.remote
class RayWorker:
    def __init__(self, config: WorkerConfig) -> None:
        from workers.worker import Worker

        self.worker = Worker(config)
        self._bitmasks: dict[int, np.ndarray] = {}
        self._posted = threading.Condition()
        self._wake: WakeReader | None = None

    def init(self) -> tuple[int, int, int]:
        """Join the process group, load this rank's shard, and report its KV block counts."""
        self.worker.init_distributed()
        self.worker.load_model()
        return self.worker.determine_num_blocks()

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, num_offload_blocks: int) -> None:
        self.worker.init_cache(num_gpu_blocks, num_cpu_blocks, num_offload_blocks)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    def open_wake_socket(self, path: str) -> None:
        """The socket this rank parks on (cluster/engine/wakeup.py)."""
        self._wake = WakeReader(path)

    def execute(self, plan: StepPlan | Park) -> StepResult | None:
        if isinstance(plan, Park):
            return self._park()
        self.worker.launch(plan)
        self._take_bitmask()
        return self.worker.collect(plan.step_id)[0]

    def execute_lagged(self, plan: StepPlan | Park | None) -> StepResult | None:
        """Launch `plan`, return the result of the plan launched before it (Worker.execute_lagged)."""
        if isinstance(plan, Park):
            return self._park()
        self._take_bitmask()  # the last step must sample before this one can launch
        return self.worker.execute_lagged(plan)

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

    def ping(self) -> bool:
        return True
