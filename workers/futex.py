"""Sleeping on a word of shared memory until another process changes it (Linux futexes).

Processes of one host that share a mapping (a file in /dev/shm) wait for each other here
without spinning: a waiter sleeps in the kernel while the word still holds the value it last
saw, and a writer that stores a new value wakes every sleeper. Shared (not private) futexes,
so the processes may map the file at different addresses.

Invariants: a waiter never misses a store, because the kernel sleeps only while the word
still equals the value the waiter passed; every sleep is bounded (`timeout_s`), so a caller
can check between sleeps whether the process it waits for still lives. x86_64 Linux only
(the syscall number below); callers check `futex_supported()` and keep another path elsewhere.
"""

from __future__ import annotations

import ctypes
import platform
import sys

_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # x86_64 Linux; shared futexes
_WAKE_ALL = 0x7FFFFFFF
_syscall = ctypes.CDLL(None, use_errno=True).syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32,
                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_supported() -> bool:
    """Whether this process can use these futexes (x86_64 Linux)."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def timespec(timeout_s: float) -> _Timespec:
    """A relative timeout for `futex_wait`, made once by a caller that waits often."""
    return _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))


def futex_wait(addr: int, seen: int, timeout: _Timespec) -> None:
    """Sleep while the 32-bit word at `addr` equals `seen` (its low 32 bits), at most `timeout`
    (a `timespec`); returns at once if it already differs. Spurious returns happen: re-check."""
    _syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, seen & 0xFFFFFFFF, ctypes.addressof(timeout), None, 0)


def futex_wake(addr: int) -> None:
    """Wake every process sleeping on the word at `addr` (after a store to it)."""
    _syscall(_SYS_FUTEX, addr, _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
