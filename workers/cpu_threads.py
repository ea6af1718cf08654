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
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
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


class ThreadScope:
    """`with scope:` runs its block on `threads` torch threads and restores the count in force
    after it (None: changes nothing). Made once and re-entered every step; not re-entrant."""

    __slots__ = ("threads", "_saved")

    def __init__(self, threads: int | None) -> None:
        self.threads = threads
        self._saved = 0

    def __enter__(self) -> None:
        if self.threads is not None:
            self._saved = torch.get_num_threads()
            if self._saved != self.threads:
                torch.set_num_threads(self.threads)

    def __exit__(self, *exc: object) -> None:
        if self.threads is not None and self._saved != self.threads:
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
