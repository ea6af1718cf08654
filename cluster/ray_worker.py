"""The Ray actor that hosts one tensor-parallel rank's Worker."""

from __future__ import annotations

import ray

from scheduler.plan import StepPlan, StepResult
from workers.config import WorkerConfig


@ray.remote
class RayWorker:
    def __init__(self, config: WorkerConfig) -> None:
        from workers.worker import Worker

        self.worker = Worker(config)

    def init(self) -> tuple[int, int]:
        """Join the process group, load this rank's shard, and report its KV block counts."""
        self.worker.init_distributed()
        self.worker.load_model()
        return self.worker.determine_num_blocks()

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.init_cache(num_gpu_blocks, num_cpu_blocks)

    def execute(self, plan: StepPlan) -> StepResult | None:
        return self.worker.execute(plan)

    def ping(self) -> bool:
        return True
