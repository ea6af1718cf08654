"""A CPU rank's torch threads (workers/cpu_threads.py): the cores less one, split over the
ranks, at least one; every core for an exclusive engine's wide model; an OMP_NUM_THREADS in
the environment wins; a narrow model's LM head and sampler on every core of an exclusive
engine."""

from __future__ import annotations

import os

import pytest
import torch

from workers import cpu_threads
from workers.cpu_threads import (
    IDLE_HEAD_MAX_ROWS,
    RunnableTasks,
    ThreadScope,
    head_threads,
    idle_head_threads,
    model_threads,
    set_model_threads,
    takes_every_core,
)


@pytest.mark.parametrize(("cores", "tp", "threads"),
                         [(2, 1, 1), (2, 2, 1), (1, 1, 1), (16, 1, 15), (16, 2, 7), (4, 8, 1)])
def test_model_threads_leave_one_core_and_split_the_rest(cores: int, tp: int,
                                                         threads: int) -> None:
    assert model_threads(tp, environ={}, cores=cores) == threads


@pytest.mark.parametrize(("cores", "tp", "threads"),
                         [(2, 1, 2), (2, 2, 1), (1, 1, 1), (16, 1, 16), (16, 2, 8), (4, 8, 1)])
def test_every_core_splits_all_of_them(cores: int, tp: int, threads: int) -> None:
    assert model_threads(tp, environ={}, cores=cores, every_core=True) == threads


def test_only_an_exclusive_engine_with_a_wide_model_takes_every_core() -> None:
    assert takes_every_core(True, 1024)  # Qwen3-0.6B's hidden size
    assert not takes_every_core(True, 128)  # qwen3-tiny's: a 2-thread region does not pay
    assert not takes_every_core(False, 4096)  # a served engine keeps the reserved core


def test_omp_num_threads_wins() -> None:
    assert model_threads(1, environ={"OMP_NUM_THREADS": "3"}, cores=16) is None
    assert model_threads(1, environ={"OMP_NUM_THREADS": "3"}, cores=16, every_core=True) is None


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


@pytest.mark.parametrize(("exclusive", "hidden_floor", "threads"),
                         [(True, 128, 3), (True, 1024, 2), (False, 128, 2)])
def test_a_worker_sets_its_threads_from_its_model_width(
        monkeypatch: pytest.MonkeyPatch, tiny_model_path: str, exclusive: bool,
        hidden_floor: int, threads: int) -> None:
    """Loading qwen3-tiny (hidden 128) on 3 cores: every core only for an exclusive worker
    whose model is at least the floor wide (the floor lowered to 128 to see it take them)."""
    from workers.config import WorkerConfig
    from workers.worker import Worker

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(cpu_threads, "EXCLUSIVE_MIN_HIDDEN", hidden_floor)
    try:
        worker = Worker(WorkerConfig(model=tiny_model_path, device="cpu", max_model_len=64,
                                     max_num_seqs=2, cpu_exclusive=exclusive))
        worker.init_distributed()
        worker.load_model()
        assert torch.get_num_threads() == threads
        worker.shutdown()
    finally:
        torch.set_num_threads(before)


def test_llm_marks_its_engine_exclusive_unless_it_schedules_async(tiny_model_path: str) -> None:
    """`LLM` is the offline engine: its workers get cpu_exclusive, except under async
    scheduling (the engine's Python then runs beside the forward pass); a bad value is a
    ValueError."""
    from cluster.engine.config import EngineConfig
    from cluster.engine.engine_setup import build_worker_config

    def worker_exclusive(**kw: object) -> bool:
        cfg = EngineConfig(model=tiny_model_path, **kw)
        return build_worker_config(cfg, tiny_model_path, "cpu", 64, 64, None, None,
                                   None).cpu_exclusive

    from cluster import LLM

    before = torch.get_num_threads()
    try:
        llm = LLM(tiny_model_path, max_model_len=64, max_num_seqs=2)
        assert llm.engine.executor.worker.config.cpu_exclusive is True
        llm.engine.executor.shutdown()
    finally:
        torch.set_num_threads(before)
    assert worker_exclusive() is False
    assert worker_exclusive(cpu_exclusive=True) is True
    assert worker_exclusive(cpu_exclusive=True, async_scheduling=True) is False
    with pytest.raises(ValueError, match="cpu_exclusive must be true or false"):
        EngineConfig(model=tiny_model_path, cpu_exclusive="yes")


@pytest.mark.parametrize(("exclusive", "hidden", "tp", "cores", "env", "threads"), [
    (True, 128, 1, 2, {}, 2),       # qwen3-tiny offline: the model on 1, its head on both
    (True, 128, 2, 16, {}, 8),
    (True, 1024, 1, 2, {}, None),   # a wide model already has every core
    (False, 128, 1, 2, {}, None),   # a served engine keeps the reserved core for its loop
    (True, 128, 1, 1, {}, None),    # one core: nothing to add
    (True, 128, 1, 16, {"OMP_NUM_THREADS": "1"}, None),  # the environment's count wins
])
def test_head_threads(exclusive: bool, hidden: int, tp: int, cores: int, env: dict,
                      threads: int | None) -> None:
    assert head_threads(exclusive, hidden, tp, environ=env, cores=cores) == threads


def test_a_thread_scope_sets_the_count_for_its_block_and_restores_it() -> None:
    before = torch.get_num_threads()
    scope, inside = ThreadScope(before + 1), []
    try:
        for _ in range(2):  # (made once, entered every step)
            with scope:
                inside.append(torch.get_num_threads())
            assert torch.get_num_threads() == before
        with pytest.raises(RuntimeError), scope:
            raise RuntimeError("a failed step")
        assert torch.get_num_threads() == before
        with ThreadScope(None):
            assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
    assert inside == [before + 1] * 2


@pytest.mark.parametrize(("exclusive", "hidden", "tp", "cores", "threads"), [
    (False, 128, 1, 2, 2),      # a served qwen3-tiny replica: both cores when both are idle
    (False, 128, 2, 16, 8),
    (False, 128, 2, 2, None),   # one core per rank: nothing to add
    (False, 1024, 1, 2, None),  # a wide model: its own count
    (True, 128, 1, 2, None),    # an exclusive engine: head_threads' every core, always
])
def test_idle_head_threads(exclusive: bool, hidden: int, tp: int, cores: int,
                           threads: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # Ray's, for a fractional actor: not a cap here
    assert idle_head_threads(exclusive, hidden, tp, cores=cores) == threads


class _Runnable(RunnableTasks):
    """/proc/loadavg's runnable count as a test sets it (the real one is read below)."""

    def __init__(self) -> None:
        super().__init__(path="/nonexistent")
        self.count: int | None = 1
        self.reads = 0

    def __call__(self) -> int | None:
        self.reads += 1
        return self.count


def test_an_idle_scope_takes_only_idle_cores_and_only_for_few_rows() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    runnable = _Runnable()
    scope = ThreadScope(4, when_idle=True, runnable=runnable, cores=4)

    def inside(rows: int, count: int | None) -> int:
        runnable.count = count
        with scope(rows):
            threads = torch.get_num_threads()
        assert torch.get_num_threads() == 1
        return threads

    try:
        assert inside(1, 1) == 4      # only this thread runnable: every core
        assert inside(1, 2) == 3      # one other task: its core is left to it
        assert inside(2, 3) == 2
        assert inside(1, 4) == 1      # every core busy: the model's count
        assert inside(1, 9) == 1
        assert inside(1, None) == 1   # no /proc/loadavg: the model's count
        reads = runnable.reads
        assert inside(IDLE_HEAD_MAX_ROWS + 1, 1) == 1  # a loaded replica: not even looked at
        assert runnable.reads == reads
        with pytest.raises(RuntimeError), scope(1):
            raise RuntimeError("a failed step")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_runnable_tasks_reads_this_machines_count() -> None:
    """/proc/loadavg counts the reader itself: at least 1, at most every task there is."""
    runnable = RunnableTasks()
    if not os.path.exists("/proc/loadavg"):
        assert runnable() is None
        return
    total = int(open("/proc/loadavg").read().split()[3].split("/")[1])
    counts = [runnable() for _ in range(3)]  # (one file, read again each time)
    assert all(c is not None and 1 <= c <= total + 64 for c in counts)
    runnable.close()
    assert runnable() is None


def test_a_served_engine_gives_its_head_the_idle_cores(
        monkeypatch: pytest.MonkeyPatch, tiny_model_path: str) -> None:
    """A served (not exclusive) in-process qwen3-tiny engine on 2 cores: its model on 1 thread,
    the head of a one-row step on 2 when /proc/loadavg shows one runnable task (this one) and
    on 1 when it shows two; the model's count after each."""
    from cluster.engine.config import EngineConfig
    from cluster.engine.llm_engine import LLMEngine
    from scheduler.sampling_params import SamplingParams

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    engine = LLMEngine(EngineConfig(model=tiny_model_path, device="cpu", max_model_len=64,
                                    max_num_seqs=2, executor="inprocess"))
    try:
        worker = engine.executor.worker
        assert worker.config.cpu_exclusive is False
        scope = worker.model_runner._head
        assert (scope.threads, scope._cores) == (2, 2)
        loadavg = {"running": 1}
        monkeypatch.setattr(scope, "_runnable", lambda: loadavg["running"])
        head = worker.model.lm_head
        seen: list[int] = []
        greedy = head.greedy_tokens

        def spy(*args: object) -> object:
            seen.append(torch.get_num_threads())
            return greedy(*args)

        monkeypatch.setattr(head, "greedy_tokens", spy)
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for running, request in ((1, "idle"), (2, "busy")):
            loadavg["running"] = running
            engine.add_request(request, [1, 2, 3], sp)
            while engine.has_unfinished():
                engine.step()
        model_threads = torch.get_num_threads()
    finally:
        engine.shutdown()
        torch.set_num_threads(before)
    assert model_threads == 1
    assert seen == [2, 2, 1, 1]  # each request: its prefill's and its decode's head


def test_a_worker_with_cpu_nice_takes_no_idle_core_for_its_head(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A background role (cpu_nice > 0: a PD app's prefill replica) yields cores by design: its
    narrow model's head keeps the model's threads instead of taking the idle ones (which are the
    decode replica's between its steps); the same worker at nice 0 looks for them."""
    from workers.config import WorkerConfig
    from workers.worker import Worker

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    served = Worker(WorkerConfig(model="qwen3-tiny", device="cpu"))._head_scope(128)
    background = Worker(WorkerConfig(model="qwen3-tiny", device="cpu", cpu_nice=10)
                        )._head_scope(128)
    assert (served.threads, served._runnable is not None) == (2, True)
    assert (background.threads, background._runnable) == (None, None)


def test_an_offline_engine_runs_a_narrow_models_head_on_every_core(
        monkeypatch: pytest.MonkeyPatch, tiny_model_path: str) -> None:
    """`LLM` with qwen3-tiny on 3 cores: the model on 2 threads, its LM head (greedy over the
    vocabulary) and its sampler (a seeded row) on 3, the model's count back after each."""
    from cluster import LLM, SamplingParams

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    try:
        llm = LLM(tiny_model_path, max_model_len=64, max_num_seqs=2)
        worker = llm.engine.executor.worker
        head, sampler = worker.model.lm_head, worker.model_runner.sampler
        seen: dict[str, list[int]] = {"head": [], "sampler": [], "after": []}

        def spy(name: str, fn):  # noqa: ANN001, ANN202 (a recording wrapper)
            def wrapped(*args: object) -> object:
                seen[name].append(torch.get_num_threads())
                return fn(*args)
            return wrapped

        monkeypatch.setattr(head, "greedy_tokens", spy("head", head.greedy_tokens))
        monkeypatch.setattr(worker.model_runner, "sampler", spy("sampler", sampler))
        monkeypatch.setattr(worker, "collect", spy("after", worker.collect))
        greedy = llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 2,
                              SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        seeded = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                              SamplingParams(temperature=0.8, seed=5, max_tokens=3),
                              use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in greedy + seeded] == [3, 3, 3]
        llm.engine.executor.shutdown()
    finally:
        torch.set_num_threads(before)
    assert seen["head"] and set(seen["head"]) == {3}  # the all-greedy steps
    assert seen["sampler"] and set(seen["sampler"]) == {3}  # the seeded request's
    assert set(seen["after"]) == {2}


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
