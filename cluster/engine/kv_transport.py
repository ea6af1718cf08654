"""The KV transfer's transport between replicas (prefill/decode disaggregation), and what
crosses from the prefill side to the decode side (`KVTransferParams`, vLLM's
`kv_transfer_params`).

A payload (workers/kv_transfer.py: one rank's blocks, one contiguous host tensor) is published
where the rank that packed it runs and fetched where the rank that unpacks it runs:
  - with Ray up, through Ray's object store: `ray.put` by the packing process (the prefill
    replica, or its rank's actor), which owns the object; the decode side's rank `ray.get`s
    it within a bound. The object is freed when the last reference is dropped, i.e. once
    the decode side has pulled it and the request's params are gone; a prefill replica that
    dies takes its objects with it, and the fetch fails (OwnerDiedError, ObjectLostError):
    the decode side then computes the prompt itself.
  - without Ray (one process: tests, the offline engine), the payload itself is the handle.
The other transport, `kv_transport: rdt` (cluster/engine/rdt_transport.py: Ray Direct
Transport, NCCL on CUDA, gloo on CPU), keeps the payload on the prefill rank's device and hands
over an `RDTHandle`, which is always ready: its pull is the decode engine's executor's. The
engine picks one per device (`EngineConfig.kv_transport`: the object store on CPU by default).

`PayloadPuller`: where the rank that unpacks a payload is the engine's own process (the
in-process executor), its object-store fetch runs on a background thread as soon as the
request arrives, never on the engine loop's thread: a `ray.get` waits on the payload's owner
(the prefill replica, whose cores are busy prefilling) and the object store, and every running
stream would wait with it (docs/benchmarks.md, prefill/decode). The loop only looks at whether
the pull is done and then reserves blocks for the fetched tensors; where the executor can write
beside its steps (its rank on this CPU), the write runs on these threads too (`write`), and the
loop admits the request once it is done.
"""

from __future__ import annotations

import concurrent.futures
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cluster.engine.metrics import Histogram

# The time one transfer takes, seconds (bytes over the host path, not a decode step's).
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)


class KVTransferError(RuntimeError):
    """A payload could not be fetched (its owner died, the object is lost, the bound passed)."""


@dataclass(slots=True)
class KVTransferParams:
    """What the prefill side hands the decode side with a request.

    `payloads[r]`: tensor-parallel rank r's payload handle (an ObjectRef, an RDTHandle, or
    the tensor itself without Ray), covering the first `num_blocks` full blocks of the prompt;
    `first_token` is the token the prefill side sampled; `block_size` and
    `tensor_parallel_size` are the prefill engine's, checked against the decode engine's.
    """

    payloads: list[Any]
    num_blocks: int
    block_size: int
    tensor_parallel_size: int
    first_token: int
    nbytes: int


@dataclass(slots=True)
class KVTransferMetrics:
    """Counters of one engine's transfers (either side) and the time histogram."""

    exports: int = 0
    imports: int = 0
    fallbacks: int = 0  # imports that failed or timed out: the prompt was recomputed
    bytes_out: int = 0
    bytes_in: int = 0
    seconds: Histogram = field(default_factory=lambda: Histogram(TRANSFER_BUCKETS))

    def as_dict(self) -> dict[str, Any]:
        return {"kv_transfer_exports_total": self.exports,
                "kv_transfer_imports_total": self.imports,
                "kv_transfer_fallbacks_total": self.fallbacks,
                "kv_transfer_bytes_out_total": self.bytes_out,
                "kv_transfer_bytes_in_total": self.bytes_in,
                "kv_transfer_seconds": self.seconds.copy()}


def _ray() -> Any:
    import ray

    return ray if ray.is_initialized() else None


def publish(payload: torch.Tensor) -> Any:
    """A handle other processes can fetch `payload` by (see the module docstring). In the
    object store it is a numpy byte array with its dtype and shape beside it (`_ObjectPayload`),
    not a tensor: Ray writes and maps a numpy array's buffer as it is (pickle 5, out of band),
    where a tensor goes through torch's own pickling, several times the CPU in the fetching
    process, taken from the decode steps that run beside the pull (docs/benchmarks.md,
    prefill/decode)."""
    ray = _ray()
    if ray is None:
        return payload
    flat = payload.contiguous().view(-1).view(torch.uint8)
    return ray.put(_ObjectPayload(flat.numpy(), payload.dtype, tuple(payload.shape)))


@dataclass(frozen=True, slots=True)
class _ObjectPayload:
    """A payload as the object store holds it (see `publish`)."""

    data: np.ndarray  # uint8, the tensor's bytes
    dtype: torch.dtype
    shape: tuple[int, ...]

    def tensor(self) -> torch.Tensor:
        """The payload as a tensor over the fetched buffer (read only: nothing writes it)."""
        with warnings.catch_warnings():  # (torch warns of a read-only buffer; it is only read)
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(self.data)
        return flat.view(self.dtype).view(self.shape)


def fetch(handle: Any, timeout_s: float) -> torch.Tensor:
    """The payload behind `handle`; KVTransferError when it cannot be had within `timeout_s`."""
    if isinstance(handle, torch.Tensor):
        return handle
    import ray

    if not isinstance(handle, ray.ObjectRef) or not ray.is_initialized():
        raise KVTransferError(f"KV payload handle {type(handle).__name__} cannot be fetched "
                              "here (not a Ray object, or Ray is not up)")
    try:
        got = ray.get(handle, timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 — owner died, object lost, timeout: all a fallback
        raise KVTransferError(f"KV payload not fetched: {type(e).__name__}: {e}") from e
    return got.tensor() if isinstance(got, _ObjectPayload) else got


def ready(handles: list[Any]) -> bool:
    """Whether every payload exists (or is known lost: its fetch then fails at once), without
    waiting or copying anything. A handle that no fetch here can serve is never ready (its
    request waits out the bound, then computes its prompt). An RDTHandle is ready: its payload
    is pulled (or found gone) by the import itself."""
    from cluster.engine.rdt_transport import RDTHandle

    pending = [h for h in handles if not isinstance(h, (torch.Tensor, RDTHandle))]
    if not pending:
        return True
    import ray

    refs = [h for h in pending if isinstance(h, ray.ObjectRef)]
    if len(refs) < len(pending) or not ray.is_initialized():
        return False
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    return len(done) == len(refs)


def _needs_fetch(handle: Any) -> bool:
    import ray

    return isinstance(handle, ray.ObjectRef)


def _pull(handles: list[Any], deadline: float) -> tuple[list[Any], float]:
    """Every handle's payload (tensors and other handles as they are), and the seconds taken;
    KVTransferError when one cannot be had by `deadline` (time.monotonic)."""
    start = time.perf_counter()
    out = [fetch(h, max(0.0, deadline - time.monotonic())) if _needs_fetch(h) else h
           for h in handles]
    return out, time.perf_counter() - start


def _write(executor: Any, block_ids: list[int], payloads: list[Any], first: int) -> float:
    start = time.perf_counter()
    executor.write_kv(block_ids, payloads, first)
    return time.perf_counter() - start


class PayloadPuller:
    """Fetches a request's object-store payloads into this process on background threads
    (see the module docstring). `start` gives a future of `(payloads, seconds)`, whose
    payloads any `fetch` returns at once; its exception is a KVTransferError."""

    # Pulls at once: a pull whose owner died waits for Ray to say so; the others go on.
    MAX_PULLS = 4

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self, handles: list[Any], deadline: float) -> concurrent.futures.Future | None:
        """A future of the pulled payloads; None when none of `handles` needs a fetch (no
        Ray, or a handle that no fetch here serves: its request waits on `ready`)."""
        if _ray() is None or not any(_needs_fetch(h) for h in handles):
            return None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.MAX_PULLS, "kv-pull")
        return self._pool.submit(_pull, list(handles), deadline)

    def write(self, executor: Any, block_ids: list[int], payloads: list[Any], first: int
              ) -> concurrent.futures.Future | None:
        """A future of the seconds it takes to write pulled `payloads` into `block_ids` on a
        background thread, beside the executor's steps (`Executor.write_kv`); None where the
        executor cannot write beside its steps (the caller writes between them)."""
        if self._pool is None or not executor.writes_kv_beside_steps:
            return None
        return self._pool.submit(_write, executor, list(block_ids), payloads, first)

    def shutdown(self) -> None:
        """Drop the pulls not yet started; one in progress ends by its deadline."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
