"""Parking idle Ray workers: a named pipe per rank that wakes them in microseconds.

A Ray Compiled Graph's actors wait for the next plan by spinning on their input channel
(`sched_yield` in a loop: most of a core per rank, forever, while the engine has no work).
When the engine goes idle it sends each rank a `Park` plan instead: the rank then blocks in
`select()` on its pipe, which costs no CPU, and returns when the engine writes a byte to it
(when work arrives), then goes back to the channel for the plan that follows.

Pipes need the engine and its ranks on one host; a Serve replica's placement group is
STRICT_PACK with the replica in bundle 0, so they are. Invariants: a rank parks only between
steps (the engine parks when nothing is in flight); every park is followed by a wake before
the engine reads anything the graph returns after it.
"""

from __future__ import annotations

import contextlib
import os
import select
import tempfile


class Park:
    """The plan that parks a rank until its pipe is written (the graph returns None for it)."""


class WakeReader:
    """A rank's end: blocks in `wait()` until the engine writes."""

    def __init__(self, path: str) -> None:
        self.path = path
        # Non-blocking open: a FIFO's read end opens before any writer exists.
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)

    def wait(self) -> None:
        """Block (no CPU) until at least one byte arrives; consume what is there."""
        while True:
            ready, _, _ = select.select([self.fd], [], [], 60.0)
            if ready:
                try:
                    data = os.read(self.fd, 64)
                except BlockingIOError:
                    continue
                if data:
                    return
                # EOF: no writer has the pipe open (the engine went away): wait for one.
                select.select([], [], [], 0.05)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class WakePipes:
    """The engine's end: one FIFO per rank in a private temporary directory."""

    def __init__(self, num_ranks: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="qwen3-serve-wake-")
        self.paths = [os.path.join(self.dir, f"rank{r}") for r in range(num_ranks)]
        for p in self.paths:
            os.mkfifo(p, 0o600)
        self.fds: list[int] = []

    def open(self) -> None:
        """Open the write ends (after every rank opened its read end)."""
        self.fds = [os.open(p, os.O_WRONLY | os.O_NONBLOCK) for p in self.paths]

    def wake(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(BlockingIOError):  # full: the rank has bytes to read
                os.write(fd, b"w")

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        for p in self.paths:
            with contextlib.suppress(OSError):
                os.unlink(p)
        with contextlib.suppress(OSError):
            os.rmdir(self.dir)
