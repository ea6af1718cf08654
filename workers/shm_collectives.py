"""All-reduce (sum) and gather-to-rank-0 of CPU tensors through one shared-memory segment per
tensor-parallel group, for ranks that all run on one host (vLLM's CPU communicator does the
same in C++: csrc/cpu/shm.cpp).

Why: on CPU the group's backend is gloo, whose TCP round trip per collective dominated a tp-2
decode step of qwen3-tiny (two all-reduces per decoder layer on `[tokens, hidden]` tensors).
Here a collective is a copy into this rank's slot, a store of a counter, a wait on the other
ranks' counters, and a read of their slots.

Layout of the segment (a file in /dev/shm, made and reserved by rank 0, its name sent to
the others through the group's torch.distributed collectives once, at `ShmCollectives.create`;
mapped with mmap rather than multiprocessing.shared_memory, whose resource tracker would
unlink or warn about a segment another process owns): one int64 sequence counter
per rank, each on its own cache line, then `2 x world_size` payload slots of `slot_bytes`:
slot (parity, rank) with parity = the collective's sequence number mod 2.

Invariants:
- Every rank of the group runs the same collectives in the same order with tensors of the
  same shape and dtype (torch.distributed's contract), so every rank numbers them alike and
  takes the same path (shared memory, or gloo for a tensor over `slot_bytes`).
- Collective s writes only the slots of parity s % 2. A rank publishes counter = s after
  it has read everything of collective s - 1, and a rank starts writing collective s + 2 only
  after every counter reached s + 1; so no slot is overwritten while another rank reads it.
- Sums run in rank order on every rank (slot 0 + slot 1 + ...), so every rank holds the same
  bits; for two ranks that is a + b, which is gloo's result too.
- Memory ordering: a rank writes its payload, then its counter (an aligned 8-byte store, not
  torn on x86_64); a reader loads the counter, then the payload. x86's total store order keeps
  both pairs in program order, and the Python calls between them are opaque to the compiler,
  so no fence is needed there. Weaker orderings (aarch64) would need fences this module does
  not have: ranks on another architecture keep gloo.
- The segment is unlinked as soon as every rank has attached: nothing is left in /dev/shm when
  a rank dies; the mapping lives until each rank closes it (`close`).
- A wait is bounded: a peer that does not arrive within `timeout_s`, or whose process is gone,
  gives a RuntimeError naming the collective (the engine's dead-rank handling takes over).

The waiter spins briefly, then sleeps in the kernel on the peer's counter (a futex on the low
32 bits of the shared counter; a rank wakes its counter's sleepers after each publish): a CPU
host often has more runnable processes than cores (two ranks and the engine's driver on two
cores), and a waiter that spins, or yields and stays runnable, takes the core of the rank it
waits for; a futex sleeper gives the core away at once and is woken as soon as the peer
publishes, as gloo's blocking socket read is.

`QWEN3_SERVE_CPU_SHM_ALLREDUCE=0` in the ranks' environment turns this path off (gloo only),
for debugging.
"""

from __future__ import annotations

import mmap
import os
import socket
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from workers.futex import futex_supported, futex_wait, futex_wake, timespec

ENV_KNOB = "QWEN3_SERVE_CPU_SHM_ALLREDUCE"
SHM_DIR = "/dev/shm"  # POSIX shared memory on Linux (what shm_open names map to)
# Per slot: qwen3-tiny's fp32 LM-head gather for 27 rows (75,968 logits a row at tp 2), or an
# all-reduce of 16,384 tokens x 128; larger tensors go through gloo. 2 x world slots, reserved
# (fallocate) at creation, so a full /dev/shm is a clean fallback and never a SIGBUS later.
SLOT_BYTES = 8 << 20
_HEADER_BYTES = 4096  # the counters, one 64-byte line per rank (up to 64 ranks)
_LINE = 64
_MAX_CACHED_VIEWS = 64
_SPINS = 64  # counter polls before sleeping on the futex
_LIVENESS_EVERY_S = 0.1  # how often a sleeping waiter checks that the peer's process lives
_NAP = timespec(_LIVENESS_EVERY_S)


def shm_enabled(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """False when `QWEN3_SERVE_CPU_SHM_ALLREDUCE` is "0" (or "false", "off", "no")."""
    return environ.get(ENV_KNOB, "1").strip().lower() not in ("0", "false", "off", "no")


def host_identity() -> tuple[str, str, int]:
    """(hostname, boot id, pid namespace): equal for processes that share /dev/shm and pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return socket.gethostname(), f"pid-{os.getpid()}", 0  # never equal to a peer's
    return socket.gethostname(), boot, pid_ns


def process_gone(pid: int) -> bool:
    """The process no longer runs (exited, or a zombie not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


def map_segment(path: str, size: int, create: bool) -> mmap.mmap:
    """Map the POSIX shared-memory file at `path` (made and reserved first when `create`)."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on a later write
        elif os.fstat(fd).st_size < size:
            raise OSError(f"{path} is smaller than {size} bytes")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)  # the mapping keeps the memory


class ShmCollectives:
    """One rank's handle on its group's segment; `create` (a collective) makes one."""

    def __init__(self, shm: mmap.mmap, path: str, rank: int, world_size: int,
                 slot_bytes: int, peer_pids: list[int], timeout_s: float) -> None:
        self.path = path  # unlinked once every rank had mapped it
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._shm: mmap.mmap | None = shm
        self._pids = peer_pids
        self._seq = 0
        self._counters = np.ndarray((world_size,), dtype=np.int64, buffer=shm,
                                    strides=(_LINE,))
        base = torch.frombuffer(shm, dtype=torch.uint8)
        self._counter_addr = [base.data_ptr() + r * _LINE for r in range(world_size)]
        self._views: dict[tuple, list[Tensor]] = {}  # (parity, dtype, shape) -> slot views
        self._slots = [[base[_HEADER_BYTES + (p * world_size + r) * slot_bytes:][:slot_bytes]
                        for r in range(world_size)] for p in range(2)]

    @staticmethod
    def segment_bytes(world_size: int, slot_bytes: int) -> int:
        return _HEADER_BYTES + 2 * world_size * slot_bytes

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, rank: int, world_size: int,
               timeout_s: float, slot_bytes: int = SLOT_BYTES) -> ShmCollectives | None:
        """Every rank of `group` calls this together. Returns None on every rank (the caller
        keeps gloo) unless every rank is on this host, on x86_64, with the knob on, and the
        segment was made and attached by all."""
        if world_size * _LINE > _HEADER_BYTES:
            raise ValueError(f"shared-memory collectives take at most {_HEADER_BYTES // _LINE} "
                             f"ranks; got world_size={world_size}")
        me = (host_identity(), futex_supported(), shm_enabled(),
              os.getpid())
        peers: list = [None] * world_size
        dist.all_gather_object(peers, me, group=group)
        if not all(p[0] == me[0] and p[1] and p[2] for p in peers):
            return None
        size = cls.segment_bytes(world_size, slot_bytes)
        shm, path = None, [""]
        if rank == 0:
            path[0] = f"{SHM_DIR}/qwen3-serve-tp-{uuid.uuid4().hex}"
            try:
                shm = map_segment(path[0], size, create=True)
            except OSError:
                path[0] = ""
        dist.broadcast_object_list(path, group=group, group_src=0)
        if rank != 0 and path[0]:
            try:
                shm = map_segment(path[0], size, create=False)
            except OSError:
                shm = None
        ok = torch.tensor([int(shm is not None)], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if rank == 0 and path[0]:
            os.unlink(path[0])  # every rank has attached (or given up): nothing left behind
        if not ok.item():
            if shm is not None:
                shm.close()
            return None
        return cls(shm, path[0], rank, world_size, slot_bytes, [p[3] for p in peers], timeout_s)

    def fits(self, x: Tensor) -> bool:
        """Whether `x` can go through the segment (else the caller uses gloo)."""
        return (self._shm is not None and x.device.type == "cpu" and x.is_contiguous()
                and x.numel() * x.element_size() <= self.slot_bytes)

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum `x` over the ranks, in place, in rank order (the same bits on every rank)."""
        views = self._exchange(x, "all_reduce")
        torch.add(views[0], views[1], out=x)
        for v in views[2:]:
            x.add_(v)
        return x

    def gather_last_dim(self, x: Tensor) -> Tensor | None:
        """Rank 0 gets every rank's `x` concatenated along the last dim; other ranks get None."""
        views = self._exchange(x, "gather_last_dim", publish=self.rank != 0)
        if self.rank != 0:
            return None
        return torch.cat([x, *views[1:]], dim=-1)  # rank 0's own part needs no slot

    def close(self) -> None:
        """Unmap the segment (its name was unlinked at creation)."""
        if self._shm is None:
            return
        self._slots, self._views = [], {}
        del self._counters
        shm, self._shm = self._shm, None
        shm.close()

    def _exchange(self, x: Tensor, name: str, publish: bool = True) -> list[Tensor]:
        """Publish `x` in this rank's slot (unless not `publish`), then the counter; wait for
        every rank's counter; the slots as `x`-shaped views."""
        self._seq += 1
        seq = self._seq
        key = (seq & 1, x.dtype, x.shape)
        views = self._views.get(key)
        if views is None:  # slicing costs more than the copy: a step's shapes repeat
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            nbytes = x.numel() * x.element_size()
            views = [s[:nbytes].view(x.dtype).view(x.shape) for s in self._slots[seq & 1]]
            self._views[key] = views
        if publish:
            views[self.rank].copy_(x)
        self._counters[self.rank] = seq  # after the payload (see the module docstring)
        futex_wake(self._counter_addr[self.rank])
        for r in range(self.world_size):
            if r != self.rank and self._counters[r] < seq:
                self._wait(r, seq, name)
        return views

    def _wait(self, peer: int, seq: int, name: str) -> None:
        counters = self._counters
        for _ in range(_SPINS):
            if counters[peer] >= seq:
                return
        start = time.monotonic()
        while (seen := int(counters[peer])) < seq:
            # Sleeps only while the word still holds `seen` (checked by the kernel), so a
            # publish between the load above and this call is never missed.
            futex_wait(self._counter_addr[peer], seen, _NAP)
            if counters[peer] >= seq:
                return
            now = time.monotonic()
            gone = process_gone(self._pids[peer])
            if gone or now - start > self.timeout_s:
                why = ("its process is gone" if gone
                       else f"it did not arrive within {self.timeout_s:g} s")
                raise RuntimeError(
                    f"shared-memory {name} (collective {seq}) on rank {self.rank} of "
                    f"{self.world_size}: rank {peer} never arrived ({why})")
