"""How many threads a CPU worker's torch ops run on (intra-op parallelism).

A CPU rank takes the cores this process may run on, less one, split over the tensor-parallel
ranks of the machine, and at least one: the remaining core is left to what is not the model
(the engine's own Python, the HTTP front, Ray's processes), as vLLM's CPU build leaves one to
its front end. An OMP_NUM_THREADS in the environment wins (a user's choice, or Ray's: an actor
process gets its CPU count, 1 for a fractional one), and then torch is left as it is.

Why fewer threads than cores: an intra-op parallel region waits for its slowest thread. When
another process holds a core (the engine's loop, a second replica, the proxy, other users of a
shared machine), every small op of a decode step waits for a thread that is not scheduled, and
a few-microsecond op takes milliseconds (docs/benchmarks.md, "CPU path", issue #43).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch


def model_threads(tensor_parallel_size: int, environ: Mapping[str, str] = os.environ,
                  cores: int | None = None) -> int | None:
    """Threads for one CPU rank, or None when OMP_NUM_THREADS is set (torch then follows it)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1; got {tensor_parallel_size}")
    if environ.get("OMP_NUM_THREADS"):
        return None
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, ((cores or 1) - 1) // tensor_parallel_size)


def set_model_threads(tensor_parallel_size: int) -> int:
    """Apply `model_threads` to this process's torch; returns the thread count in force."""
    threads = model_threads(tensor_parallel_size)
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
