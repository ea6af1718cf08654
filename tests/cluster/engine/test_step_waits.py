"""The engine waits for a tp-2 step asleep, not spinning (cluster/engine/wakeup.py's
CallCounter, cluster/engine/host_channel.py's `done` words): the counter across processes,
and the engine's read thread on Ray with each plan transport."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest

from cluster import LLM, SamplingParams
from cluster.engine import host_channel
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


@pytest.mark.parametrize("transport", ["host channel", "compiled graph"])
def test_tp2_engine_reads_step_outputs_asleep(transport: str, ray_cluster: None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """While the ranks compute, the thread that reads their outputs sleeps: on the output
    rank's counter with the compiled graph (Ray's own read yields in a loop for the whole
    step: close to all of it), on the host channel's `done` words with that
    (cluster/engine/host_channel.py). Its CPU time over a 48-step generate is a small share
    of the wall time."""
    monkeypatch.setenv(host_channel.ENV_KNOB, "1" if transport == "host channel" else "0")
    llm = LLM("qwen3-tiny", tensor_parallel_size=2, executor="ray", worker_num_cpus=0.5,
              device="cpu")
    try:
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
        first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        # the compiled graph's reads run on its DagCaller's thread, the channel's on the
        # group's own graph thread (a ThreadPoolExecutor's, "dag_0")
        name = "dag-calls" if transport == "compiled graph" else "dag_0"
        assert (llm.engine.executor._g.channel is not None) == (transport == "host channel")
        reader = next(t for t in threading.enumerate() if t.name == name)
        cpu, wall = _thread_cpu_s(reader.native_id), time.monotonic()
        again = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        cpu, wall = _thread_cpu_s(reader.native_id) - cpu, time.monotonic() - wall
        assert again == first and len(again) == 48
        assert cpu < 0.25 * wall, (cpu, wall)
    finally:
        llm.shutdown()


def test_a_host_without_room_for_the_channel_runs_the_compiled_graph(
        ray_cluster: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm full (a container's 64 MB default, say): the executor logs it and its ranks
    take the compiled graph, with the same greedy tokens."""
    from cluster.engine import plan_calls

    def no_room(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 — HostChannel's signature
        raise OSError(28, "No space left on device")

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    tokens = []
    for full in (False, True):
        if full:
            monkeypatch.setattr(plan_calls, "HostChannel", no_room)
        llm = LLM("qwen3-tiny", tensor_parallel_size=2, executor="ray", worker_num_cpus=0.5,
                  device="cpu")
        try:
            group = llm.engine.executor._g
            assert (group.channel is None, group.dag is not None) == (full, full)
            tokens.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8
