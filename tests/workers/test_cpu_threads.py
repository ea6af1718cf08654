"""A CPU rank's torch threads (workers/cpu_threads.py): the cores less one, split over the
ranks, at least one; an OMP_NUM_THREADS in the environment wins."""

from __future__ import annotations

import pytest
import torch

from workers.cpu_threads import model_threads, set_model_threads


@pytest.mark.parametrize(("cores", "tp", "threads"),
                         [(2, 1, 1), (2, 2, 1), (1, 1, 1), (16, 1, 15), (16, 2, 7), (4, 8, 1)])
def test_model_threads_leave_one_core_and_split_the_rest(cores: int, tp: int,
                                                         threads: int) -> None:
    assert model_threads(tp, environ={}, cores=cores) == threads


def test_omp_num_threads_wins() -> None:
    assert model_threads(1, environ={"OMP_NUM_THREADS": "3"}, cores=16) is None


def test_bad_tensor_parallel_size_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        model_threads(0, environ={}, cores=2)


def test_set_model_threads_applies_it(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    try:
        assert set_model_threads(1) == 2 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("nice", [-1, 20, 2.5, True, "10"])
def test_cpu_nice_outside_0_to_19_is_a_value_error(nice: object) -> None:
    from cluster.engine.config import EngineConfig
    from workers.config import WorkerConfig

    with pytest.raises(ValueError, match=r"cpu_nice must be an integer in 0\.\.19"):
        EngineConfig(model="qwen3-tiny", cpu_nice=nice)
    with pytest.raises(ValueError, match=r"cpu_nice must be an integer in 0\.\.19"):
        WorkerConfig(model="qwen3-tiny", cpu_nice=nice)


_NICE_CHILD = r"""
import os, threading, json
from cluster import LLM, SamplingParams

def nices():
    return sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")})

started = threading.Event()
old = threading.Thread(target=started.wait, daemon=True)  # a thread older than the engine
old.start()
llm = LLM("qwen3-tiny", device="cpu", executor="inprocess", cpu_nice=7, max_model_len=256)
out = llm.generate([{"prompt_token_ids": [1000, 2000, 3000]}],
                   SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
later = {}
t = threading.Thread(target=lambda: later.update(n=os.getpriority(os.PRIO_PROCESS, 0)))
t.start(); t.join()
print(json.dumps({"all": nices(), "later": later["n"], "tokens": len(out[0].outputs[0].token_ids)}))
"""


def test_an_engine_with_cpu_nice_lowers_every_thread_of_its_process() -> None:
    """In a child process (this one must keep its priority): the threads the process had,
    those the engine made and one started after are all at nice 7, and it still generates."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _NICE_CHILD], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"all": [7], "later": 7, "tokens": 4}
