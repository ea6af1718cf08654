"""Parking idle Ray workers: a named socket per rank that wakes them in microseconds.

A Ray Compiled Graph's actors wait for the next plan by spinning on their input channel
(`sched_yield` in a loop: most of a core per rank, forever, while the engine has no work).
When the engine goes idle it sends each rank a `Park` plan instead: the rank then blocks in
`select()` on its own UNIX datagram socket, which costs no CPU, and returns when the engine
sends it a datagram (when work arrives), then goes back to the channel for the plan that
follows.

The sockets need the engine and its ranks on one host; a Serve replica's placement group is
STRICT_PACK with the replica in bundle 0, so they are. Invariants: a rank parks only between
steps (the engine parks when nothing is in flight); every park is followed by a wake before
the engine reads anything the graph returns after it.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import tempfile


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
