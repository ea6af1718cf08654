"""Waiting without spinning on a compiled graph: idle ranks park on a named socket per rank,
and the engine sleeps on a counter of finished calls before it reads a call's output. (Ranks
on the engine's host get the host channel instead, host_channel.py, which sleeps by itself;
this is for a graph whose ranks share the host only in part, or with that channel off.)

A Ray Compiled Graph's actors wait for the next plan by spinning on their input channel
(`sched_yield` in a loop: most of a core per rank, forever, while the engine has no work).
When the engine goes idle it sends each rank a `Park` plan instead: the rank then blocks in
`select()` on its own UNIX datagram socket, which costs no CPU, and returns when the engine
sends it a datagram (when work arrives), then goes back to the channel for the plan that
follows.

The engine's side of a step spins the same way: Ray's read of a call's output yields in a loop
until every rank has written it, for the whole step. On a CPU host the ranks need the cores it
spins on (two ranks and the engine on two cores: the engine burned more CPU per step than both
ranks' forward passes together, docs/benchmarks.md, issue #43). So the output rank counts its
finished calls in a shared page (`CallCounter`, one futex word), and the engine sleeps on it
until the call it reads has finished; the read that follows waits only for Ray's write of the
output, which comes right after.

The sockets and the counter need the engine and its ranks on one host; a Serve replica's
placement group is STRICT_PACK with the replica in bundle 0, so they are. Invariants: a rank
parks only between steps (the engine parks when nothing is in flight); every park is followed
by a wake before the engine reads anything the graph returns after it. The output rank adds
one to the counter at the end of every call the graph makes on it (a park, a failed step
included), so the n-th output the engine reads exists once the counter reaches n; the engine
waits in bounded sleeps and gives up the wait as soon as its group is stopped.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import socket
import tempfile
import uuid
from collections.abc import Callable

import numpy as np

from workers.futex import futex_supported, futex_wait, futex_wake, timespec

# How often the engine, asleep on the counter, checks whether it should stop waiting.
_COUNTER_NAP = timespec(0.05)
_PAGE = 4096


class Park:
    """The plan that parks a rank until it is woken (the graph returns None for it)."""


class WakeReader:
    """A rank's end: blocks in `wait()` until the engine sends a wake-up."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.setblocking(False)

    def wait(self) -> None:
        """Block (no CPU) until a wake-up arrives; consume every one queued."""
        while True:
            ready, _, _ = select.select([self.sock], [], [], 60.0)
            if not ready:
                continue
            woken = False
            with contextlib.suppress(BlockingIOError):
                while True:
                    self.sock.recv(16)
                    woken = True
            if woken:
                return

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class WakeSockets:
    """The engine's end: one named datagram socket per rank in a private directory.

    Datagrams, not FIFOs: writing to a FIFO whose reader died raises SIGPIPE, which would kill
    the engine's process right when it must rebuild a dead rank; a datagram to a dead rank
    just fails."""

    def __init__(self, num_ranks: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="qwen3-wake-")
        self.paths = [os.path.join(self.dir, f"r{r}") for r in range(num_ranks)]
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)

    def wake(self) -> None:
        for path in self.paths:
            with contextlib.suppress(OSError):  # full, or the rank is gone: nothing to do
                self.sock.sendto(b"w", path)

    def close(self) -> None:
        self.sock.close()
        for path in self.paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(self.dir)


class CallCounter:
    """How many graph calls the output rank has finished: one int64 in a page of /dev/shm that
    the engine makes (`create`) and the rank maps (`attach`); the rank `bump`s it, the engine
    `wait_for`s it. The file is unlinked once the rank has attached (`unlink`)."""

    def __init__(self, path: str, create: bool) -> None:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, _PAGE)
            self._map = mmap.mmap(fd, _PAGE)
        finally:
            os.close(fd)
        self.path = path
        self._word = np.ndarray((1,), dtype=np.int64, buffer=self._map)
        self._addr = self._word.ctypes.data

    @classmethod
    def create(cls) -> CallCounter | None:
        """The engine's end, or None where futexes or /dev/shm are not there (then it reads
        the graph's outputs as Ray does)."""
        if not futex_supported() or not os.path.isdir("/dev/shm"):
            return None
        try:
            return cls(f"/dev/shm/qwen3-calls-{uuid.uuid4().hex}", create=True)
        except OSError:
            return None

    @classmethod
    def attach(cls, path: str) -> CallCounter:
        """The output rank's end."""
        return cls(path, create=False)

    @property
    def count(self) -> int:
        return int(self._word[0])

    def bump(self) -> None:
        """One more call finished (the rank's only writer: no lost update)."""
        self._word[0] += 1
        futex_wake(self._addr)

    def wait_for(self, n: int, stop: Callable[[], bool]) -> None:
        """Sleep until the count reaches `n`, or until `stop()` says to give up (checked
        between bounded sleeps)."""
        while (seen := self.count) < n and not stop():
            futex_wait(self._addr, seen, _COUNTER_NAP)

    def unlink(self) -> None:
        """Remove the file (idempotent); the page stays mapped until this object is dropped,
        so a wait still asleep on it never touches unmapped memory."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)
