"""The host channel (cluster/engine/host_channel.py) between this process (the engine's end)
and ranks in processes of their own (spawned, as Ray's actors are other processes): messages
reach every rank in order and each rank's output comes back in order; payloads larger than a
slot go through files of their own that nothing leaves behind; a rank's error is that call's
output and the rank serves on; a dead rank, a caller that gives up, and too many calls in
flight each raise; closing ends the ranks' loops; an idle rank sleeps."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from cluster.engine import host_channel
from cluster.engine.host_channel import (
    MIN_SLOTS,
    ChannelStopped,
    HostChannel,
    RankEnd,
    RankFailedError,
)

pytestmark = pytest.mark.skipif(not host_channel.enabled(),
                                reason="needs x86-64 Linux and /dev/shm")

SMALL_SLOT = 4096  # so that a test payload overflows a slot cheaply


def _handle(rank: int, msg):  # noqa: ANN001, ANN202 — the ranks' stand-in for RayWorker.execute
    if msg is None:
        return None
    kind, value = msg
    if kind == "fail":
        raise ValueError(f"bad value {value}")
    if kind == "sleep":
        time.sleep(value)
        return ("slept", rank)
    if kind == "exit":
        os._exit(3)
    return (kind, rank, value * 2 if isinstance(value, np.ndarray) else value)


def _serve(path: str, rank: int, num_ranks: int, slots: int, slot_bytes: int,
           keep: bool) -> None:
    end = RankEnd(path, rank, num_ranks, slots, slot_bytes)
    end.serve(lambda msg: _handle(rank, msg), keep)


def _ranks(num_ranks: int = 2, slots: int = MIN_SLOTS, slot_bytes: int = SMALL_SLOT):
    channel = HostChannel(num_ranks, slots, slot_bytes)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_serve,
                         args=(channel.path, r, num_ranks, slots, slot_bytes, r == 0),
                         daemon=True) for r in range(num_ranks)]
    for p in procs:
        p.start()
    return channel, procs


def _attach(channel: HostChannel, procs: list) -> None:
    """The ranks map the file during their start; wait for it, as the executor's actor call."""
    deadline = time.monotonic() + 60
    m = channel.write(("echo", 0), stop=lambda: False)
    channel.read(m, stop=lambda: time.monotonic() > deadline)
    channel.attached([p.pid for p in procs])


def _close(channel: HostChannel, procs: list) -> None:
    channel.close()
    for p in procs:
        p.join(10)


def never() -> bool:
    return False


def test_messages_reach_every_rank_in_order_and_outputs_come_back_in_order() -> None:
    channel, procs = _ranks()
    try:
        _attach(channel, procs)
        assert not os.path.exists(channel.path)  # unlinked once every rank had mapped it
        arrays = [np.arange(i, i + 5) for i in range(3)]
        sent = [channel.write(("echo", a), never) for a in arrays]
        assert sent == [2, 3, 4]
        for m, a in zip(sent, arrays):
            outs = channel.read(m, never)
            assert outs[1] is None  # only the output rank's result is sent back
            kind, rank, value = outs[0]
            assert (kind, rank) == ("echo", 0)
            np.testing.assert_array_equal(value, a * 2)
    finally:
        _close(channel, procs)
    assert [p.exitcode for p in procs] == [0, 0]  # closing ended both loops


def test_a_payload_larger_than_a_slot_goes_through_a_file_that_is_then_removed() -> None:
    channel, procs = _ranks()
    try:
        _attach(channel, procs)
        big = np.arange(10 * SMALL_SLOT, dtype=np.int64)  # 80 slots' worth each way
        m = channel.write(("echo", big), never)
        out = channel.read(m, never)[0]
        np.testing.assert_array_equal(out[2], big * 2)
        channel.write(("echo", 1), never)  # the next write removes the input's file
        channel.read(m + 1, never)
        prefix = os.path.basename(channel.path)
        assert [f for f in os.listdir("/dev/shm") if f.startswith(prefix)] == []
    finally:
        _close(channel, procs)


def test_a_ranks_error_is_its_calls_output_and_the_rank_serves_on() -> None:
    channel, procs = _ranks()
    try:
        _attach(channel, procs)
        m = channel.write(("fail", 7), never)
        with pytest.raises(RankFailedError, match="rank 0: ValueError: bad value 7"):
            channel.read(m, never)
        m = channel.write(("echo", 8), never)
        assert channel.read(m, never)[0] == ("echo", 0, 8)
    finally:
        _close(channel, procs)


def test_a_dead_rank_is_named_within_a_second() -> None:
    channel, procs = _ranks()
    try:
        _attach(channel, procs)
        procs[1].kill()
        procs[1].join(10)
        m = channel.write(("echo", 1), never)
        start = time.monotonic()
        gone = f"rank 1's process \\(pid {procs[1].pid}\\) is gone"
        with pytest.raises(RuntimeError, match=gone):
            channel.read(m, never)
        assert time.monotonic() - start < 1.0
    finally:
        _close(channel, procs)


def test_a_caller_that_gives_up_stops_the_wait() -> None:
    channel, procs = _ranks()
    try:
        _attach(channel, procs)
        m = channel.write(("sleep", 30.0), never)
        start = time.monotonic()
        with pytest.raises(ChannelStopped):
            channel.read(m, stop=lambda: time.monotonic() - start > 0.3)
        assert time.monotonic() - start < 2.0
    finally:
        for p in procs:
            p.kill()
        _close(channel, procs)


@pytest.mark.parametrize("slots", [MIN_SLOTS, 10])
def test_more_calls_in_flight_than_slots_is_refused_and_reading_out_of_order_too(
        slots: int) -> None:
    """(10 slots: a pipeline of 8 stages' calls in flight, plus two.)"""
    channel, procs = _ranks(slots=slots)
    try:
        _attach(channel, procs)
        sent = [channel.write(("echo", i), never) for i in range(slots)]
        with pytest.raises(RuntimeError, match=f"at most {slots} calls in flight"):
            channel.write(("echo", -1), never)
        with pytest.raises(RuntimeError, match="read after"):
            channel.read(sent[1], never)
        assert [channel.read(m, never)[0][2] for m in sent] == list(range(slots))
        m = channel.write(("echo", 99), never)  # a slot is free again
        assert channel.read(m, never)[0][2] == 99
    finally:
        _close(channel, procs)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_rank_sleeps_and_wakes_for_the_next_message() -> None:
    channel, procs = _ranks()
    try:
        _attach(channel, procs)
        before = [_cpu_seconds(p.pid) for p in procs]
        time.sleep(2.0)
        used = [_cpu_seconds(p.pid) - b for p, b in zip(procs, before)]
        assert all(u < 0.1 for u in used), used  # a spinning rank burns the whole 2 s
        start = time.monotonic()
        m = channel.write(("echo", 5), never)
        assert channel.read(m, never)[0] == ("echo", 0, 5)
        assert time.monotonic() - start < 0.5  # woken by the write, not by its 0.5 s nap
    finally:
        _close(channel, procs)


def test_a_rank_that_exits_mid_call_fails_the_read_not_hangs_it() -> None:
    channel, procs = _ranks()
    try:
        _attach(channel, procs)
        m = channel.write(("exit", None), never)  # both ranks exit inside the call
        with pytest.raises(RuntimeError, match="process .* is gone"):
            channel.read(m, never)
    finally:
        _close(channel, procs)


def test_bad_rank_and_slot_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="takes 1..31 ranks"):
        HostChannel(0)
    with pytest.raises(ValueError, match="takes 1..31 ranks"):
        HostChannel(32)
    with pytest.raises(ValueError, match="at least 4 slots, not 3"):
        HostChannel(2, slots=3)
