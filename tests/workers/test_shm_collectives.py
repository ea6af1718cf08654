"""Shared-memory all-reduce and gather (workers/shm_collectives.py) against gloo's, in spawned
ranks of a real `TensorParallelGroup`: the same values (fp32 and bf16; world 2 and 3), the same
bits on every rank, hundreds of collectives back to back with a rank that lags at random (the
slot-reuse race), tensors over the slot through gloo, and a bounded error, not a hang, when a
peer never arrives or dies.

World 3 compares with gloo on integer-valued tensors: gloo's ring sums each chunk in a
different rank order, so on arbitrary floats only two ranks give a + b in every order.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from workers_testlib import run_ranks

from workers import shm_collectives
from workers.distributed import TensorParallelGroup
from workers.shm_collectives import ShmCollectives

HIDDEN = 128
SMALL_SLOT = 64 * HIDDEN * 4  # 64 fp32 rows of HIDDEN: the "max" of the size tests
ROWS = (1, 2, 3, 7, 64, 129, 1000)


def _data(seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype,
          integers: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 97 + rank)
    if integers:
        return torch.randint(-8, 9, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _compare(tp: TensorParallelGroup, shm: ShmCollectives, dtype: torch.dtype,
             iterations: int) -> dict[str, Any]:
    """Each collective through `shm` and through gloo on the same input; mismatches and a
    digest of every shared-memory result (equal on every rank when the bits are)."""
    integers = tp.world_size > 2
    digest, mismatches, via_shm = hashlib.sha256(), [], 0
    lag = torch.Generator().manual_seed(1234 + tp.rank)
    for i in range(iterations):
        rows = ROWS[i % len(ROWS)]
        x = _data(i, tp.rank, (rows, HIDDEN), dtype, integers)
        if torch.rand((), generator=lag) < 0.1:
            time.sleep(0.002)  # this rank lags: the others run ahead into the next slots
        via_shm += shm.fits(x)
        got = shm.all_reduce(x.clone()) if shm.fits(x) else None
        want = x.clone()
        dist.all_reduce(want, group=tp.group)
        if got is not None:
            digest.update(got.view(torch.uint8).numpy().tobytes())
            if not torch.equal(got, want):
                mismatches.append(f"all_reduce {i} rows {rows}")
        part = _data(i + 10_000, tp.rank, (rows, 2 + i % 5), dtype, integers)
        if shm.fits(part):
            full = shm.gather_last_dim(part)
            parts = [torch.empty_like(part) for _ in range(tp.world_size)] if tp.is_first else None
            dist.gather(part, parts, group=tp.group, group_dst=0)
            if tp.is_first and not torch.equal(full, torch.cat(parts, dim=-1)):
                mismatches.append(f"gather {i} rows {rows}")
            if not tp.is_first and full is not None:
                mismatches.append(f"gather {i}: rank {tp.rank} got a result")
    return {"mismatches": mismatches, "digest": digest.hexdigest(), "via_shm": via_shm}


def case_equal_gloo(tp: TensorParallelGroup) -> dict[str, Any]:
    """The default segment (TensorParallelGroup's own) and a 64-row one, fp32 and bf16; a
    tensor of exactly the slot goes through shared memory, one row more through gloo, and the
    group's own all_reduce / gather_last_dim agree with gloo on both."""
    assert tp.shm is not None and tp.shm.slot_bytes == shm_collectives.SLOT_BYTES
    small = ShmCollectives.create(tp.group, tp.rank, tp.world_size, 60.0, SMALL_SLOT)
    out: dict[str, Any] = {"unlinked": not os.path.exists(small.path)}
    for dtype in (torch.float32, torch.bfloat16):
        out[f"default {dtype}"] = _compare(tp, tp.shm, dtype, 300)
        out[f"small {dtype}"] = _compare(tp, small, dtype, 300)
    integers = tp.world_size > 2
    tp_small = TensorParallelGroup(tp.rank, tp.world_size, tp.group)
    tp_small.shm = small
    edge = []
    for rows in (64, 65):  # the slot's max, then one row past it (gloo)
        x = _data(rows, tp.rank, (rows, HIDDEN), torch.float32, integers)
        want = x.clone()
        dist.all_reduce(want, group=tp.group)
        gathered = tp_small.gather_last_dim(x)
        edge.append((small.fits(x), torch.equal(tp_small.all_reduce(x.clone()), want),
                     None if gathered is None else list(gathered.shape)))
    out["edge"] = edge
    small.close()
    return out


def case_peer_never_arrives(tp: TensorParallelGroup) -> dict[str, Any]:
    shm = ShmCollectives.create(tp.group, tp.rank, tp.world_size, 1.0, SMALL_SLOT)
    if tp.rank == 1:
        tp.barrier()  # after rank 0's error: this rank never called the collective
        return {}
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        shm.all_reduce(torch.ones(4, HIDDEN))
    elapsed = time.monotonic() - start
    tp.barrier()
    return {"error": str(err.value), "elapsed": elapsed}


def case_peer_dies(tp: TensorParallelGroup) -> dict[str, Any]:
    shm = ShmCollectives.create(tp.group, tp.rank, tp.world_size, 600.0, SMALL_SLOT)
    if tp.rank == 1:
        os._exit(0)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        shm.all_reduce(torch.ones(4, HIDDEN))
    return {"error": str(err.value), "elapsed": time.monotonic() - start}


def case_off(tp: TensorParallelGroup) -> dict[str, Any]:
    """The knob or another host on one rank: gloo on every rank, and collectives still work."""
    x = torch.full((3, HIDDEN), float(tp.rank + 1))
    return {"shm": tp.shm is not None, "sum": tp.all_reduce(x)[0, 0].item()}


@pytest.mark.parametrize("world", [2, 3])
def test_shm_collectives_equal_gloo_bit_for_bit_on_every_rank(world: int) -> None:
    out = run_ranks(world, case_equal_gloo)
    for key in ("default torch.float32", "small torch.float32", "default torch.bfloat16",
                "small torch.bfloat16"):
        for r in range(world):
            assert out[r][key]["mismatches"] == [], (r, key)
        assert len({out[r][key]["digest"] for r in range(world)}) == 1, key
    # Every size fits the default slot; the 64-row slot takes 1..64 rows and gloo the rest.
    assert out[0]["default torch.float32"]["via_shm"] == 300
    assert out[0]["small torch.float32"]["via_shm"] == sum(ROWS[i % len(ROWS)] <= 64
                                                           for i in range(300))
    assert out[0]["unlinked"]
    assert out[0]["edge"] == [(True, True, [64, HIDDEN * world]), (False, True, [65, HIDDEN * world])]
    assert out[1]["edge"] == [(True, True, None), (False, True, None)]


def test_peer_that_never_arrives_gives_a_bounded_error() -> None:
    out = run_ranks(2, case_peer_never_arrives)
    assert "shared-memory all_reduce" in out[0]["error"]
    assert "rank 1 never arrived (it did not arrive within 1 s)" in out[0]["error"]
    assert 1.0 <= out[0]["elapsed"] < 10.0


def test_peer_that_died_fails_the_wait_without_the_timeout() -> None:
    out = run_ranks(2, case_peer_dies, expect=1, finish=False)
    assert "rank 1 never arrived (its process is gone)" in out[0]["error"]
    assert out[0]["elapsed"] < 30.0  # the timeout is 600 s


@pytest.mark.parametrize("env, hosts", [
    ({shm_collectives.ENV_KNOB: "0"}, None),
    ({}, ["host-a", "host-b"]),
], ids=["knob-off", "two-hosts"])
def test_knob_off_or_another_host_keeps_gloo_on_every_rank(env, hosts) -> None:
    out = run_ranks(2, case_off, env=env, hosts=hosts)
    assert out == {0: {"shm": False, "sum": 3.0}, 1: {"shm": False, "sum": 3.0}}


def test_default_group_uses_shared_memory() -> None:
    out = run_ranks(2, case_off)
    assert out == {0: {"shm": True, "sum": 3.0}, 1: {"shm": True, "sum": 3.0}}
