"""The KV cache's host<->GPU copies on the side copy stream (workers/copy_stream.py): the order
of begin / copies / end / wait around a step, on CPU with a recording stream; on CUDA, that the
copies really run on another stream than the compute, after the compute before them, before the
compute after them, and bitwise."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from test_kv_offload import _prefill
from workers_testlib import LocalExecutor

from scheduler.plan import StepPlan
from workers.cache_engine import CacheEngine
from workers.copy_stream import CopyStream

CPU = torch.device("cpu")


class RecordingStream(CopyStream):
    """A CPU CopyStream that logs each call and what a watched GPU block holds at that point."""

    def __init__(self, cache: CacheEngine, watched: int, log: list) -> None:
        super().__init__(CPU)
        self.cache, self.watched, self.log = cache, watched, log

    def _note(self, what: str) -> None:
        self.log.append((what, self.cache.gpu_cache[:, :, self.watched].clone()))

    def begin(self) -> None:
        self._note("begin")
        super().begin()

    def end(self) -> None:
        super().end()
        self._note("end")

    def wait(self) -> None:
        self._note("wait" if self.pending else "wait (nothing pending)")
        super().wait()


def _engine(log: list, watched: int) -> CacheEngine:
    eng = CacheEngine(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, num_gpu_blocks=6,
                      num_cpu_blocks=2, dtype=torch.float32, device=CPU, num_offload_blocks=3)
    eng.gpu_cache.copy_(torch.randn(eng.gpu_cache.shape, generator=torch.Generator().manual_seed(0)))
    eng.copy_stream = RecordingStream(eng, watched, log)
    return eng


def test_a_step_is_one_batch_of_copies_then_one_wait_before_copy_on_write() -> None:
    log: list = []
    eng = _engine(log, watched=5)
    original = eng.gpu_cache.clone()
    eng.transfer(offload=np.array([[1, 2]]), swap_out=np.array([[0, 1]]),
                 swap_in=np.array([[1, 4]]), load=np.array([[2, 5]]))
    assert [what for what, _ in log] == ["begin", "end"]  # one batch: one fence, one event
    assert torch.equal(log[0][1], original[:, :, 5])  # nothing copied before the fence
    # at `end`: block 1 went out to the tier and came back into 5 (a load reads the tier
    # block its own step's offload wrote: one stream keeps the plan's order)
    assert torch.equal(log[1][1], original[:, :, 1])
    assert torch.equal(eng.gpu_cache[:, :, 4], original[:, :, 0])
    eng.copy(np.array([[5, 3]]))  # copy-on-write may read a block just loaded: waits first
    assert [what for what, _ in log] == ["begin", "end", "wait"]
    eng.wait_transfers()
    assert log[-1][0] == "wait (nothing pending)"
    assert torch.equal(eng.gpu_cache[:, :, 3], original[:, :, 1])


def test_bad_ids_enqueue_no_copy_at_all() -> None:
    log: list = []
    eng = _engine(log, watched=4)
    before = eng.gpu_cache.clone()
    with pytest.raises(ValueError, match="load tier block id out of range"):
        eng.transfer(swap_in=np.array([[0, 4]]), load=np.array([[3, 0]]))
    assert log == [] and torch.equal(eng.gpu_cache, before)  # the valid swap-in did not run
    eng.transfer()  # a step with no copies: no fence, no event, nothing to wait for
    eng.wait_transfers()
    assert [what for what, _ in log] == ["wait (nothing pending)"]


def test_worker_waits_for_the_copies_before_the_forward(tiny_dir: str) -> None:
    ex = LocalExecutor(model=tiny_dir, num_gpu_blocks=16, num_cpu_blocks=2, num_offload_blocks=4,
                       max_model_len=256)
    try:
        worker = ex.worker
        log: list = []
        worker.cache_engine.copy_stream = RecordingStream(worker.cache_engine, 0, log)
        runner = worker.model_runner
        forward = runner.forward
        runner.forward = lambda *args: (log.append(("forward", None)), forward(*args))[1]
        plan = replace(_prefill(1, 1, list(range(300, 316)), [3]),
                       offload=np.array([[0, 1]], dtype=np.int64),
                       load=np.array([[1, 2]], dtype=np.int64))
        ex.execute(plan)
        assert [what for what, _ in log] == ["begin", "end", "wait", "forward"]
        empty = np.zeros(0, dtype=np.int64)
        ex.execute(StepPlan(step_id=2, seq_ids=empty, query_lens=empty.astype(np.int32),
                            start_pos=empty.astype(np.int32), input_ids=empty,
                            do_sample=np.zeros(0, bool),
                            swap_out=np.array([[3, 0]], dtype=np.int64)))
        assert [what for what, _ in log[4:]] == ["begin", "end", "wait"]  # no forward: waits too
    finally:
        ex.close()


@pytest.mark.gpu
def test_cuda_copies_run_on_the_side_stream_between_the_compute_around_them() -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    eng = CacheEngine(3, 2, 8, 16, num_gpu_blocks=12, num_cpu_blocks=5, dtype=torch.bfloat16,
                      device=dev, num_offload_blocks=4)
    assert eng.offload_cache.is_pinned() and eng.cpu_cache.is_pinned()
    eng.gpu_cache.copy_(torch.randn(eng.gpu_cache.shape, device=dev))
    original = eng.gpu_cache.clone()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")  # no copy waits on the host
        try:
            torch.cuda._sleep(50_000_000)  # compute still running when the copies are enqueued
            eng.transfer(offload=np.array([[2, 3], [7, 0]]), swap_out=np.array([[5, 4]]))
            eng.wait_transfers()
            for b in (2, 5, 7):  # the evicted blocks' new owners write them
                eng.gpu_cache[:, :, b].zero_()
            eng.transfer(swap_in=np.array([[4, 9]]), load=np.array([[3, 10], [0, 11]]))
            eng.wait_transfers()
            loaded = torch.stack([eng.gpu_cache[:, :, b] for b in (10, 11, 9)])  # compute reads
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    bits = lambda t: t.view(torch.int16)  # noqa: E731
    assert torch.equal(bits(loaded), bits(torch.stack([original[:, :, b] for b in (2, 7, 5)])))
    gpu_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = [e for e in gpu_events if e.name.startswith("Memcpy")]
    spin = [e for e in gpu_events if "spin_kernel" in e.name]
    assert len(copies) == 6 and len(spin) == 1, [e.name for e in gpu_events]
    streams = {e.device_resource_id for e in copies}
    assert len(streams) == 1 and spin[0].device_resource_id not in streams  # one side stream
    assert min(e.time_range.start for e in copies) >= spin[0].time_range.end
