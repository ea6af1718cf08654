"""Ray Direct Transport (RDT) for prefill/decode disaggregation's KV payloads
(`kv_transport: rdt`): each prefill rank's payload goes to the decode rank of the same index
over a collective group of the two (NCCL on CUDA, gloo on CPU), kept on the device on both
sides (no host copy on GPU). The object-store transport is cluster/engine/kv_transport.py's.

A pull, driven by the decode engine:
  - prefill rank (`RayWorker.stash_kv`): packs its shard on its device
    (workers/kv_transfer.py) into its `PayloadStash` under a fresh key, and the blocks are
    freed as soon as the copy is out; the handle (`RDTHandle`: the rank's actor handle and the
    key) crosses to the decode side in `KVTransferParams`.
  - decode engine (`RDTPeers.import_kv`): (1) asks every prefill rank whether it still holds
    its payload (a dead rank or a dropped payload: KVTransferError, the prompt is computed);
    (2) pairs prefill rank i with its own rank i in a collective group of two; (3) calls the
    prefill rank's `take_kv` with `tensor_transport=<backend>` (the tensor stays in that actor;
    the ref is owned here) and passes the ref to its rank's `import_kv_rdt`: Ray sends the
    tensor over the pair's group (send on the prefill actor, recv on the decode actor) before
    the method writes it into the blocks.
The decode engine owns the refs and the groups because Ray resolves an RDT object's
communicator in the process that hands the ref to the receiving actor, among the groups that
process created; a ref borrowed from another process brings no group with it.

Groups: an actor is in at most one group per backend in a process's view (Ray's rule), so a
decode engine is paired with one prefill replica at a time; a payload from another replica
tears down the pairs and makes new ones (a rendezvous: the cost of switching peers). Ray
2.60's gloo group is built on the process's default torch.distributed world: a tp > 1 rank
already has one (its tensor-parallel group), so gloo RDT runs at tp 1 only (CPU's default
stays the object store), a rank leaves that world with its pair, and a prefill rank still
paired with another decode replica is not joinable (that transfer falls back).

Bounds (the transfer's `kv_transfer_timeout_s`): every wait here is bounded; the decode rank
writes only if the payload arrived before the deadline (wall clock), and the engine waits
`GRACE_S` past it for the answer, so no write lands in blocks the engine has given back. A
payload never pulled is dropped by the prefill rank once its bound passed. A peer that dies
during a send: Ray 2.60 cannot abort a collective, so its RDT monitor kills both actors of
the failed transfer; the decode engine then rebuilds its group (its requests recompute).
"""

from __future__ import annotations

import importlib.util
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from cluster.engine.config import EngineConfig
from cluster.engine.kv_transport import KVTransferError

# The collective backend RDT uses on each device.
RDT_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
# How long past a transfer's deadline the engine waits for a rank's answer: longer than any
# write of a payload that arrived in time takes.
GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class RDTHandle:
    """Rank r's payload, kept on the prefill rank's device until the decode rank pulls it."""

    actor: Any  # the prefill rank's RayWorker
    key: str
    backend: str  # "nccl" | "gloo"


def resolve_kv_transport(config: EngineConfig, device: str) -> str:
    """`config.kv_transport` for an engine on `device`: None picks rdt on CUDA with the Ray
    executor and cupy (what Ray's NCCL groups run on), else object_store; an explicit rdt
    that cannot run here is a ValueError that says what to change."""
    choice = config.kv_transport
    nccl_ready = importlib.util.find_spec("cupy") is not None
    if choice is None:
        return "rdt" if device == "cuda" and config.uses_ray and nccl_ready else "object_store"
    if choice != "rdt" or config.kv_role is None:
        return choice
    if not config.uses_ray:
        raise ValueError("kv_transport 'rdt' moves KV between Ray worker actors; set executor "
                         "'ray' (a tp 1 replica runs in-process by default) or kv_transport "
                         "'object_store'")
    if device == "cpu" and config.tensor_parallel_size > 1:
        raise ValueError("kv_transport 'rdt' on CPU runs over Ray's gloo group, which takes the "
                         "rank's default torch.distributed world, and a tensor_parallel_size "
                         f"{config.tensor_parallel_size} rank has one already; use kv_transport "
                         "'object_store' (CPU's default) or tensor_parallel_size 1")
    if device == "cuda" and not nccl_ready:
        raise ValueError("kv_transport 'rdt' on CUDA runs over Ray's NCCL groups, which need "
                         "cupy: pip install cupy-cuda12x, or set kv_transport 'object_store'")
    return choice


class PayloadStash:
    """A prefill rank's packed payloads waiting to be pulled: each taken once, or dropped
    once its bound passed (the decode side has fallen back by then)."""

    def __init__(self) -> None:
        self._items: dict[str, tuple[torch.Tensor, float]] = {}
        self._lock = threading.Lock()

    def put(self, key: str, payload: torch.Tensor, ttl_s: float) -> None:
        with self._lock:
            self._expire()
            self._items[key] = (payload, time.monotonic() + ttl_s)

    def has(self, key: str) -> bool:
        with self._lock:
            self._expire()
            return key in self._items

    def take(self, key: str) -> torch.Tensor:
        with self._lock:
            self._expire()
            item = self._items.pop(key, None)
        if item is None:
            raise KVTransferError(f"KV payload {key} is gone (taken, or its bound passed)")
        return item[0]

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, (_, until) in self._items.items() if until <= now]:
            del self._items[key]


def new_key() -> str:
    return uuid.uuid4().hex


def _joinable(self: Any) -> bool:
    """(On a rank, by `__ray_call__`.) Whether it can join a gloo pair: Ray's gloo group would
    otherwise make a subgroup of the world it is in already."""
    import torch.distributed as dist

    return not dist.is_initialized()


def _leave_world(self: Any) -> None:
    """(On a rank, by `__ray_call__`.) Leave the default world a gloo pair made."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class RDTPeers:
    """A decode engine's collective groups with one prefill replica's ranks, and its pulls
    (see the module docstring)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._groups: list[Any] = []
        self._pairs: list[tuple[Any, Any]] = []

    def import_kv(self, workers: list, handles: list[RDTHandle], block_ids: list[int],
                  first: int, timeout_s: float) -> list[str | None]:
        """Pull `handles[r]` into rank r's blocks `block_ids` (from payload block `first`);
        each rank's reason for not writing, or None. KVTransferError when the payloads
        cannot be had (a prefill rank gone, its payload dropped, no pair) within the bound;
        a failure of a decode rank itself reaches the caller as Ray's error."""
        import ray

        deadline = time.monotonic() + timeout_s
        if any(not isinstance(h, RDTHandle) or h.backend != self.backend for h in handles):
            raise KVTransferError(f"KV payload handles are not {self.backend} RDT handles "
                                  "(the prefill side runs another kv_transport)")
        prefill = [h.actor for h in handles]
        try:
            held = ray.get([a.has_kv.remote(h.key) for a, h in zip(prefill, handles)],
                           timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 — a dead or stuck prefill rank: fall back
            raise KVTransferError(f"prefill ranks not reachable: {type(e).__name__}: {e}") from e
        if not all(held):
            raise KVTransferError("a prefill rank no longer holds its KV payload (its bound "
                                  "passed, or it was rebuilt)")
        self._pair(prefill, workers, deadline)
        wall_deadline = time.time() + max(0.0, deadline - time.monotonic())
        refs = [a.take_kv.options(tensor_transport=self.backend).remote(h.key)
                for a, h in zip(prefill, handles)]
        calls = [w.import_kv_rdt.remote(block_ids, ref, first, wall_deadline)
                 for w, ref in zip(workers, refs)]
        wait_s = max(0.0, deadline - time.monotonic()) + GRACE_S
        done, _ = ray.wait(calls, num_returns=len(calls), timeout=wait_s)
        if len(done) < len(calls):
            raise KVTransferError(f"KV payloads not received within {timeout_s:.1f} s")
        try:
            return ray.get(calls)
        except Exception as e:  # noqa: BLE001 — judged below: the peer's or ours
            if _alive(workers):
                raise KVTransferError(f"KV pull failed: {type(e).__name__}: {e}") from e
            raise

    def _pair(self, prefill: list, decode: list, deadline: float) -> None:
        """Rank i of `prefill` and of `decode` in one group each (kept while both stay)."""
        import ray
        from ray.experimental.collective import create_collective_group

        pairs = list(zip(prefill, decode))
        if pairs == self._pairs:
            return
        self.close()
        if self.backend == "gloo":
            try:
                free = ray.get([a.__ray_call__.remote(_joinable) for a in prefill],
                               timeout=max(0.1, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001
                raise KVTransferError(f"prefill ranks not reachable: {e}") from e
            if not all(free):
                raise KVTransferError("a prefill rank is paired with another decode replica "
                                      "over gloo (Ray's gloo group is one world per process)")
        try:
            for p, d in pairs:
                self._pairs.append((p, d))  # (before: a half-made gloo pair must leave too)
                self._groups.append(create_collective_group(
                    [p, d], backend="torch_gloo" if self.backend == "gloo" else "nccl"))
        except Exception as e:  # noqa: BLE001 — a rendezvous that failed: no pair, fall back
            self.close()
            raise KVTransferError(f"no {self.backend} group with the prefill ranks: "
                                  f"{type(e).__name__}: {e}") from e

    def close(self) -> None:
        """Tear the pairs down (best effort: a peer may be gone)."""
        import ray
        from ray.experimental.collective import destroy_collective_group

        groups, self._groups = self._groups, []
        pairs, self._pairs = self._pairs, []
        for group in groups:
            try:
                destroy_collective_group(group)
            except Exception:  # noqa: BLE001, S110 — a dead member: nothing left to destroy
                pass
        if self.backend == "gloo":
            members = [a for pair in pairs for a in pair]
            leaving = [a.__ray_call__.remote(_leave_world) for a in members]
            ray.wait(leaving, num_returns=len(leaving), timeout=10)


def _alive(workers: list) -> bool:
    """Whether every decode rank answers a ping (within 5 s)."""
    import ray

    try:
        ray.get([w.ping.remote() for w in workers], timeout=5)
    except Exception:  # noqa: BLE001
        return False
    return True
