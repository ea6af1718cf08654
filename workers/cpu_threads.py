"""How many threads a CPU worker's torch ops run on (intra-op parallelism).

A CPU rank takes the cores this process may run on, less one, split over the tensor-parallel
ranks of the machine, and at least one: the remaining core is left to what is not the model
(the engine's own Python, the HTTP front, Ray's processes), as vLLM's CPU build leaves one to
its front end. An OMP_NUM_THREADS in the environment wins (a user's choice, or Ray's: an actor
process gets its CPU count, 1 for a fractional one), and then torch is left as it is.

The exception, `exclusive`: an engine whose process runs nothing else while its model computes
(an offline `LLM`: its step loop is synchronous, so its Python and the model never run at the
same time, and there is no HTTP front or second replica) gives the model every core, split
over its ranks, when the model's layers are wide enough for a parallel region to pay
(`EXCLUSIVE_MIN_HIDDEN`): measured on 2 cores, 2 threads against 1 took the Qwen3-0.6B-shape
bf16 workload from 29.9 to 35.2 tok/s but qwen3-tiny (hidden 128, fp32) from 452 to 412
(docs/benchmarks.md, "Threads for an offline engine", issue #43). A served engine keeps the
reserved core: its event loop streams the last step's tokens while the model computes.

A narrow model in an exclusive engine still gives its LM head and sampler every core
(`head_threads`, entered through a `ThreadScope` around them): the head is one GEMM of
`[rows, hidden] x [hidden, vocab]` (151,936 columns for Qwen3) and an argmax over its output,
milliseconds per call where a 2-thread region's fork and join are microseconds; switching the
count is an OpenMP setting, not a new pool (docs/benchmarks.md, "The LM head on every core",
issue #43).

A narrow model in a served engine takes more cores for its LM head and sampler only for a
step of at most IDLE_HEAD_MAX_ROWS rows and only cores idle at that moment (`idle_head_threads`,
a `ThreadScope` with `when_idle`, entered as `scope(rows)`): entering reads the machine's
runnable tasks (/proc/loadavg's fourth field, which counts the caller) and takes one more thread
per core that nothing else is ready to run on, never a busy one. On two replicas of qwen3-tiny
on 2 cores (`manifests/qwen3-tiny-2x.yaml`) at concurrency 1 the other replica's core is idle,
and the head at one row, 6.2 ms of a ~10 ms decode step, took 3.1 on two threads (oneDNN's
packed GEMM; the one-row product over a transposed copy in column blocks that replaced it,
kernels/cpu_linear.py, takes ~3.5 on one thread and ~2.6 on two). A replica
with more rows is under load, where a core found idle is soon the other replica's again and
the head's second thread then waits for it (without the row cap, -2 to -3 % request throughput
at concurrency 8 and 32); it keeps the model's one thread (docs/benchmarks.md, "The LM head on
an idle core", #43). So does an engine at a lower CPU priority (`cpu_nice`, below): it is there
to yield cores (a PD app's prefill role), and a core idle between the decode role's steps is
the decode role's.

Why fewer threads than cores: an intra-op parallel region waits for its slowest thread. When
another process holds a core (the engine's loop, a second replica, the proxy, other users of a
shared machine), every small op of a decode step waits for a thread that is not scheduled, and
a few-microsecond op takes milliseconds (docs/benchmarks.md, "CPU path", issue #43).

A worker's process may also run at a lower CPU priority (`cpu_nice`, set per engine): Linux
keeps a nice value per thread and a new thread inherits its creator's, so `set_process_nice`
sets every thread the process has; the threads made later follow. It only ever lowers the
priority (an unprivileged process cannot raise it back).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

# The narrowest hidden size whose model an exclusive engine gives every core: its GEMMs stream
# megabytes of weights per call, where a 2-thread region's fork and join are noise; at
# qwen3-tiny's 128 every op is a few microseconds and waiting for the second thread costs more.
EXCLUSIVE_MIN_HIDDEN = 1024

# The most rows (sequences sampled in a step) for which a served engine's head looks for idle
# cores: at concurrency 1 a tp-1 replica's steps sample 1 row; a replica with more is loaded.
IDLE_HEAD_MAX_ROWS = 2


def process_cores() -> int:
    """The cores this process may run on (its affinity; the machine's count where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def takes_every_core(exclusive: bool, hidden_size: int) -> bool:
    """Whether a CPU rank gives its model every core (see the module docstring): an exclusive
    engine's process, and layers at least EXCLUSIVE_MIN_HIDDEN wide."""
    return exclusive and hidden_size >= EXCLUSIVE_MIN_HIDDEN


def model_threads(tensor_parallel_size: int, environ: Mapping[str, str] = os.environ,
                  cores: int | None = None, every_core: bool = False) -> int | None:
    """Threads for one CPU rank, or None when OMP_NUM_THREADS is set (torch then follows it).
    `every_core` (`takes_every_core`): no core is left to the rest of the process."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1; got {tensor_parallel_size}")
    if environ.get("OMP_NUM_THREADS"):
        return None
    if cores is None:
        cores = process_cores()
    return max(1, ((cores or 1) - (0 if every_core else 1)) // tensor_parallel_size)


def head_threads(exclusive: bool, hidden_size: int, tensor_parallel_size: int,
                 environ: Mapping[str, str] = os.environ, cores: int | None = None) -> int | None:
    """Threads for the LM head and sampler of a CPU rank whose model keeps a core free (a
    narrow model in an exclusive engine: every core), or None: they run on the model's count."""
    if not exclusive or takes_every_core(exclusive, hidden_size):
        return None
    every = model_threads(tensor_parallel_size, environ, cores, every_core=True)
    rest = model_threads(tensor_parallel_size, environ, cores)
    return every if every is not None and every != rest else None


def idle_head_threads(exclusive: bool, hidden_size: int, tensor_parallel_size: int,
                      cores: int | None = None) -> int | None:
    """The most threads a served (not `exclusive`) engine's narrow model may give its LM head
    and sampler when cores are idle (a `ThreadScope` with `when_idle`), or None: a wide model,
    an exclusive engine (`head_threads`) or one core per rank. The cores this process may run
    on, split over the tensor-parallel ranks; an OMP_NUM_THREADS (Ray sets 1 for a fractional
    actor) does not cap it: the scope takes only cores nothing else is ready to run on."""
    if exclusive or hidden_size >= EXCLUSIVE_MIN_HIDDEN:
        return None
    every = model_threads(tensor_parallel_size, {}, cores, every_core=True)
    return every if every is not None and every > 1 else None


class RunnableTasks:
    """The machine's runnable tasks right now, the caller included (/proc/loadavg's fourth
    field, "running/total"), read with one pread on a file kept open; None where there is no
    such file."""

    __slots__ = ("_fd",)

    def __init__(self, path: str = "/proc/loadavg") -> None:
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY)
        except OSError:
            self._fd = None

    def __call__(self) -> int | None:
        if self._fd is None:
            return None
        fields = os.pread(self._fd, 128, 0).split()
        return int(fields[3].split(b"/")[0]) if len(fields) > 3 else None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    __del__ = close  # (a worker's scope lives as long as its model runner)


class ThreadScope:
    """`with scope:` runs its block on `threads` torch threads and restores the count in force
    after it (None: changes nothing). With `when_idle`, `with scope(rows):` does so only for a
    block of at most `max_rows` rows, and on at most as many threads as there are cores with
    nothing else runnable on them, plus the caller's own (`RunnableTasks`): the count in force
    when every core is busy. Made once and re-entered every step; not re-entrant."""

    __slots__ = ("threads", "max_rows", "_saved", "_changed", "_runnable", "_cores", "_rows")

    def __init__(self, threads: int | None, when_idle: bool = False,
                 runnable: RunnableTasks | None = None, cores: int | None = None,
                 max_rows: int = IDLE_HEAD_MAX_ROWS) -> None:
        self.threads = threads
        self.max_rows = max_rows
        self._saved = 0
        self._changed = False
        self._rows = 0
        self._runnable = (runnable or RunnableTasks()) if when_idle and threads else None
        if cores is None and self._runnable is not None:
            cores = process_cores()
        self._cores = cores or 1

    def __call__(self, rows: int) -> ThreadScope:
        """The scope for a block over `rows` rows (what `when_idle` caps)."""
        self._rows = rows
        return self

    def __enter__(self) -> None:
        want = self.threads
        if want is None:
            return
        self._saved = torch.get_num_threads()
        if self._runnable is not None:
            running = self._runnable() if self._rows <= self.max_rows else None
            want = self._saved if running is None else min(
                want, max(self._saved, self._saved + self._cores - running))
        self._changed = self._saved != want
        if self._changed:
            torch.set_num_threads(want)

    def __exit__(self, *exc: object) -> None:
        if self._changed:
            self._changed = False
            torch.set_num_threads(self._saved)


def check_cpu_nice(nice: object) -> None:
    """ValueError unless `nice` is an integer nice value in 0..19."""
    if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
        raise ValueError("cpu_nice must be an integer in 0..19 (the nice value of the engine's "
                         "worker processes; e.g. 10 for a prefill/decode app's prefill role); "
                         f"got {nice!r}")


def set_process_nice(nice: int) -> int:
    """Lower every thread of this process to nice `nice` (those already lower stay); returns
    the calling thread's nice value after it. 0 changes nothing."""
    check_cpu_nice(nice)
    if nice and hasattr(os, "setpriority"):
        tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
        for tid in map(int, tasks):
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
            except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
                continue
    return os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0


def set_model_threads(tensor_parallel_size: int, every_core: bool = False) -> int:
    """Apply `model_threads` to this process's torch; returns the thread count in force."""
    threads = model_threads(tensor_parallel_size, every_core=every_core)
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
