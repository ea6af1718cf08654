"""`HostChannel`: a tensor-parallel group's plans to every rank, and each rank's output back,
through one shared-memory segment, for a group whose ranks all run on the engine's host.

Why: on one host the Ray Compiled Graph (ray_executor.py) cost a tp-2 step ~3.5 ms of wall time
around the ranks' forward pass at concurrency 1 (the plan's write through the graph's caller
thread and channel, the ranks' way back from their park socket to the graph's loop, the
output's read through the caller thread): a quarter of a qwen3-tiny decode step and a seventh
of its first token (docs/benchmarks.md, issue #43). Here a plan is a pickle copied into a slot,
a counter stored and one futex wake; a rank sleeps in the kernel on that counter between
steps (no Park plans, no wake sockets, no CPU while idle) and answers the same way. The graph
stays for ranks on other hosts, which no shared memory reaches.

Layout of the segment (a file in /dev/shm made and reserved by the engine, mapped by every
rank, unlinked as soon as all have mapped it):
- a header page of int64 words, each on its own cache line: `written` (messages the engine has
  written; every rank sleeps on it), `closed`, and per rank `taken` (messages it has read) and
  `done` (messages whose output it has written; the engine sleeps on it);
- `slots` input slots of `slot_bytes`: message m (numbered from 1) in slot m % slots;
- per rank `slots` output slots of `slot_bytes`: its output of message m in slot m % slots.
`slots` is at least MIN_SLOTS and two more than the calls its engine keeps in flight (one per
pipeline stage, two with async scheduling: `RayExecutor._open_channel`).
A slot holds an int64 length, then the pickled payload. A payload larger than the slot goes to
a file of its own in /dev/shm (length -n: the slot holds its n-byte name), removed by its last
reader (the engine, for an input: once every rank has taken it).

Invariants:
- One writer per word: the engine writes `written`, `closed` and the input slots; rank r its
  `taken`, `done` and output slots. A payload is written before the counter that publishes it
  and read after the counter was seen (x86's total store order, as workers/shm_collectives.py;
  callers check `supported()`, which is x86-64 Linux only).
- The engine writes message m only after every rank has taken m - slots and it has read every
  output up to m - slots, so no slot is overwritten while it may still be read; more than
  `slots` calls in flight is a caller's bug (RuntimeError), never a wait.
- Outputs are read in message order, each once. A rank's error is its output (`RankFailure`:
  the exception's type, text and traceback), raised by the engine's read as RankFailedError.
- Every wait is bounded sleeps: the engine checks between them that every rank's process lives
  and that its caller has not given up (`stop`); a rank checks `closed`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.futex import futex_supported, futex_wait, futex_wake, timespec
from workers.shm_collectives import map_segment, process_gone

logger = logging.getLogger(__name__)

ENV_KNOB = "QWEN3_SERVE_HOST_CHANNEL"
MIN_SLOTS = 4
# A 256-sequence decode plan pickles to ~7 KB, its result to ~4 KB; a prefill plan of 8,192
# tokens to ~70 KB. A tp-2 group's segment: 4 x 256 KiB x 3 = 3 MiB of /dev/shm.
SLOT_BYTES = 256 << 10
_PAGE = 4096
_LINE = 64
_LEN = 8  # the int64 length before a payload
_WRITTEN, _CLOSED = 0, 1  # header lines; then rank r's `taken` at 2 + r, `done` at 2 + R + r
_MAX_RANKS = (_PAGE // _LINE - 2) // 2
_ENGINE_NAP = timespec(0.05)  # how often a waiting engine checks the ranks' processes
_RANK_NAP = timespec(0.5)  # how often an idle rank checks `closed`


class RankFailedError(RuntimeError):
    """A rank's call raised: its exception's type, text and traceback, as the rank sent them."""


class ChannelStopped(RuntimeError):
    """The engine's caller gave up the wait (its group is stopping)."""


@dataclass(frozen=True, slots=True)
class RankFailure:
    """What a rank sends instead of an output when its call raised (any exception pickles
    this way, whether or not it pickles itself)."""

    rank: int
    error: str  # "TypeName: text"
    trace: str


def enabled(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether an engine on this host uses a channel for ranks beside it: futexes (x86-64
    Linux) and a /dev/shm, unless ENV_KNOB is "0" (or "false", "off", "no": the compiled
    graph then runs there too, for debugging and for its tests)."""
    off = environ.get(ENV_KNOB, "1").strip().lower() in ("0", "false", "off", "no")
    return not off and futex_supported() and os.path.isdir("/dev/shm")


def segment_bytes(num_ranks: int, slots: int = MIN_SLOTS, slot_bytes: int = SLOT_BYTES) -> int:
    return _PAGE + slots * slot_bytes * (1 + num_ranks)


class _Segment:
    """The mapping and its words; shared by both ends."""

    def __init__(self, path: str, num_ranks: int, slots: int, slot_bytes: int,
                 create: bool) -> None:
        if not 1 <= num_ranks <= _MAX_RANKS:
            raise ValueError(f"a host channel takes 1..{_MAX_RANKS} ranks, not {num_ranks}")
        if slots < MIN_SLOTS:
            raise ValueError(f"a host channel takes at least {MIN_SLOTS} slots, not {slots}")
        self.map = map_segment(path, segment_bytes(num_ranks, slots, slot_bytes), create)
        self.path, self.num_ranks = path, num_ranks
        self.slots, self.slot_bytes = slots, slot_bytes
        self.words = np.ndarray((_PAGE // _LINE,), dtype=np.int64, buffer=self.map,
                                strides=(_LINE,))
        base = self.words.ctypes.data
        self.addr = [base + i * _LINE for i in range(_PAGE // _LINE)]
        self.view = memoryview(self.map)

    def taken(self, rank: int) -> int:
        return 2 + rank

    def done(self, rank: int) -> int:
        return 2 + self.num_ranks + rank

    def input_slot(self, m: int) -> int:
        return _PAGE + (m % self.slots) * self.slot_bytes

    def output_slot(self, rank: int, m: int) -> int:
        return _PAGE + (self.slots * (1 + rank) + m % self.slots) * self.slot_bytes

    def put(self, offset: int, payload: bytes) -> str | None:
        """`payload` into the slot at `offset`; one larger than the slot into a file of its own,
        whose name is returned (the slot holds the name)."""
        n, side = len(payload), None
        if _LEN + n > self.slot_bytes:
            side = f"{self.path}-{uuid.uuid4().hex[:12]}"
            with open(side, "xb") as f:
                f.write(payload)
            payload = side.encode()
            n = -len(payload)
        self.view[offset:offset + _LEN] = n.to_bytes(_LEN, "little", signed=True)
        self.view[offset + _LEN:offset + _LEN + abs(n)] = payload
        return side

    def get(self, offset: int, remove_side: bool) -> Any:
        n = int.from_bytes(self.view[offset:offset + _LEN], "little", signed=True)
        data = self.view[offset + _LEN:offset + _LEN + abs(n)]
        if n >= 0:
            return pickle.loads(data)
        side = bytes(data).decode()
        with open(side, "rb") as f:
            obj = pickle.loads(f.read())
        if remove_side:
            with contextlib.suppress(OSError):
                os.unlink(side)
        return obj

    def publish(self, word: int, value: int) -> None:
        self.words[word] = value
        futex_wake(self.addr[word])

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.view.release()
            del self.words
            self.map.close()


class HostChannel:
    """The engine's end: `write` a message to every rank, `read` their outputs in order."""

    def __init__(self, num_ranks: int, slots: int = MIN_SLOTS,
                 slot_bytes: int = SLOT_BYTES) -> None:
        self._seg = _Segment(f"/dev/shm/qwen3-plans-{uuid.uuid4().hex}", num_ranks, slots,
                             slot_bytes, create=True)
        self.slots = slots
        self.path = self._seg.path
        self.num_ranks = num_ranks
        self._written = 0
        self._read = 0
        self._pids: list[int] = []
        self._inputs_aside: list[tuple[int, str]] = []  # (message, file) of oversized inputs
        self._writing = threading.Lock()  # (writes come from the engine's threads in turn)

    def attached(self, pids: list[int]) -> None:
        """Every rank has mapped the segment (its pid in rank order): remove the file."""
        self._pids = list(pids)
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def write(self, obj: Any, stop: Callable[[], bool]) -> int:
        """Send `obj` to every rank; its message number (what `read` takes)."""
        with self._writing:
            return self._write(obj, stop)

    def _write(self, obj: Any, stop: Callable[[], bool]) -> int:
        seg, m = self._seg, self._written + 1
        if m - self._read > seg.slots:
            raise RuntimeError(f"host channel: message {m} written with {m - 1 - self._read} "
                               f"outputs unread (at most {seg.slots} calls in flight)")
        for r in range(self.num_ranks):  # slot m % slots last held message m - slots
            self._wait(seg.taken(r), m - seg.slots, stop)
        self._drop_inputs_aside()
        side = seg.put(seg.input_slot(m), pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        if side is not None:
            self._inputs_aside.append((m, side))
        self._written = m
        seg.publish(_WRITTEN, m)
        return m

    def read(self, m: int, stop: Callable[[], bool]) -> list[Any]:
        """Every rank's output of message `m` (the next unread), in rank order.
        RankFailedError when a rank's call raised; RuntimeError when a rank's process is gone;
        ChannelStopped when `stop()` says to give up."""
        if m != self._read + 1 or m > self._written:
            raise RuntimeError(f"host channel: output {m} read after {self._read} "
                               f"({self._written} written)")
        seg = self._seg
        for r in range(self.num_ranks):
            self._wait(seg.done(r), m, stop)
        outs = [seg.get(seg.output_slot(r, m), remove_side=True) for r in range(self.num_ranks)]
        self._read = m
        failed = next((o for o in outs if isinstance(o, RankFailure)), None)
        if failed is not None:
            logger.warning("host channel: rank %d's call raised:\n%s", failed.rank, failed.trace)
            raise RankFailedError(f"rank {failed.rank}: {failed.error}")
        return outs

    def close(self) -> None:
        """Tell every rank's loop to end (idempotent); the mapping is dropped with this object."""
        self._seg.publish(_CLOSED, 1)
        self._drop_inputs_aside(every=True)
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _wait(self, word: int, value: int, stop: Callable[[], bool]) -> None:
        seg = self._seg
        while (seen := int(seg.words[word])) < value:
            futex_wait(seg.addr[word], seen, _ENGINE_NAP)
            if int(seg.words[word]) >= value:
                return
            if stop():
                raise ChannelStopped("host channel: the wait was given up")
            gone = [r for r, pid in enumerate(self._pids) if process_gone(pid)]
            if gone:
                raise RuntimeError(f"host channel: rank {gone[0]}'s process (pid "
                                   f"{self._pids[gone[0]]}) is gone")

    def _drop_inputs_aside(self, every: bool = False) -> None:
        if not self._inputs_aside:
            return
        least = min(int(self._seg.words[self._seg.taken(r)]) for r in range(self.num_ranks))
        keep = []
        for m, side in self._inputs_aside:
            if every or m <= least:
                with contextlib.suppress(OSError):
                    os.unlink(side)
            else:
                keep.append((m, side))
        self._inputs_aside = keep


class RankEnd:
    """Rank `rank`'s end: `serve(handle)` runs every message through `handle` until closed."""

    def __init__(self, path: str, rank: int, num_ranks: int,
                 slots: int = MIN_SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        self._seg = _Segment(path, num_ranks, slots, slot_bytes, create=False)
        self.rank = rank
        self._next = 1

    def serve(self, handle: Callable[[Any], Any], keep: bool) -> None:
        """Take each message in order, run `handle` on it, send back its result (when `keep`,
        else None: only the output rank's result is read) or its error. Returns when the
        engine closes the channel."""
        seg, rank = self._seg, self.rank
        taken, done = seg.taken(rank), seg.done(rank)
        while True:
            m = self._next
            while (seen := int(seg.words[_WRITTEN])) < m:
                if seg.words[_CLOSED]:
                    return
                futex_wait(seg.addr[_WRITTEN], seen, _RANK_NAP)
            if seg.words[_CLOSED]:
                return
            try:
                msg = seg.get(seg.input_slot(m), remove_side=False)
                seg.words[taken] = m  # (the engine waits on it only when the ring is full)
                futex_wake(seg.addr[taken])
                out = handle(msg)
                out = out if keep else None
                payload = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as e:  # noqa: BLE001 — any failure is this call's output
                seg.words[taken] = m
                payload = pickle.dumps(RankFailure(rank, f"{type(e).__name__}: {e}",
                                                   traceback.format_exc()))
            seg.put(seg.output_slot(rank, m), payload)
            self._next = m + 1
            seg.publish(done, m)
