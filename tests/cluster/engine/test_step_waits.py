"""The engine waits for a tp-2 step asleep, not spinning (cluster/engine/wakeup.py's
CallCounter): the counter across processes, and the engine's read thread on Ray."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

from cluster import LLM, SamplingParams
from cluster.engine.wakeup import CallCounter


def _bump_later(path: str, delay_s: float, times: int) -> None:
    counter = CallCounter.attach(path)
    for _ in range(times):
        time.sleep(delay_s)
        counter.bump()


def test_call_counter_wait_sleeps_until_another_process_bumps() -> None:
    counter = CallCounter.create()
    assert counter is not None  # x86_64 Linux with /dev/shm
    child = mp.get_context("spawn").Process(target=_bump_later, args=(counter.path, 0.3, 2))
    child.start()
    try:
        # the rank's end maps the file; the engine's then unlinks it (nothing left behind)
        deadline = time.monotonic() + 30
        while counter.count == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # (the child's start: imports, then its first bump)
        assert counter.count == 1
        counter.unlink()
        assert not os.path.exists(counter.path)
        wall, cpu = time.monotonic(), time.thread_time()
        counter.wait_for(2, stop=lambda: False)
        wall, cpu = time.monotonic() - wall, time.thread_time() - cpu
        assert counter.count == 2
        assert wall > 0.2  # it waited for the second bump ...
        assert cpu < 0.05, cpu  # ... asleep: a spinning wait burns the whole 0.3 s
    finally:
        child.join(30)
    assert child.exitcode == 0


def test_call_counter_wait_returns_when_told_to_stop() -> None:
    counter = CallCounter.create()
    assert counter is not None
    counter.unlink()
    counter.bump()
    counter.wait_for(1, stop=lambda: False)  # reached already: returns at once
    start = time.monotonic()
    counter.wait_for(2, stop=lambda: time.monotonic() - start > 0.2)  # never bumped
    assert 0.2 < time.monotonic() - start < 5
    assert counter.count == 1


def _thread_cpu_s(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_tp2_engine_reads_step_outputs_asleep(ray_cluster: None) -> None:
    """While the ranks compute, the thread that reads the graph's outputs sleeps on the
    output rank's counter: its CPU time over a 48-step generate is a small share of the
    wall time (Ray's own read yields in a loop for the whole step: close to all of it)."""
    llm = LLM("qwen3-tiny", tensor_parallel_size=2, executor="ray", worker_num_cpus=0.5,
              device="cpu")
    try:
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
        first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        reader = next(t for t in threading.enumerate() if t.name == "dag-calls")
        cpu, wall = _thread_cpu_s(reader.native_id), time.monotonic()
        again = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        cpu, wall = _thread_cpu_s(reader.native_id) - cpu, time.monotonic() - wall
        assert again == first and len(again) == 48
        assert cpu < 0.25 * wall, (cpu, wall)
    finally:
        llm.shutdown()
