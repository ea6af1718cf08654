"""Prefill/decode disaggregation at the engine: a prefill engine's finished prompts leave as
KV payloads, a decode engine's requests arrive with them (`EngineConfig.kv_role`).

Prefill side (`export`): the request ran with max_tokens 1; when its output finishes, its
prompt's full blocks (cached, free until reused) are held (kvcache/transfer.py), every rank
packs its shard into one payload and publishes it (Executor.export_kv: the object store,
cluster/engine/kv_transport.py, or with `kv_transport: rdt` kept on the rank's device for
the decode side's pull, rdt_transport.py), and the hold is released: the blocks are freed as soon as
the copy is out, never while it is read, with no timer. The output carries
`KVTransferParams` (payload handles, block count, first token).

Decode side (`receive`, then `admit_ready`): the request waits here, not in the scheduler,
until its payloads are here or its bound (`kv_transfer_timeout_s`) passed. With the ranks in
this process (the in-process executor), `receive` starts pulling the payloads into it on a
background thread (kv_transport.PayloadPuller), so the engine loop never waits on the object
store; with Ray ranks, each rank pulls its own, and the request waits until its payloads exist
(`ray.wait` without copying). Then, with no plan in flight (the engine calls
`admit_ready` only then, so a freed block that a step in flight still writes is never
reused under it), it takes free blocks for the hashes its prefix cache lacks, every rank
fetches and writes its payload (Executor.import_kv), and the blocks join the prefix cache
under the prompt's hashes. With the payloads pulled into this process and its rank on this
CPU (`Executor.writes_kv_beside_steps`), the write runs on a background thread beside the
next steps instead (no plan uses the reserved blocks until the request is admitted, at the
first look after the write is done): between two steps, its first touch of fresh pages held
up every running stream (docs/benchmarks.md, prefill/decode). The request is admitted as a
resumed one with the first token as its output: the prefix cache hits every received block,
and only the partial last block's tokens (and the first token) are computed. A payload that
cannot be fetched (the prefill replica died, the object is lost, the bound passed) or a pool
without room: the blocks go back unhashed and the request is admitted the same way,
computing its prompt itself: nothing lost, nothing hangs.

Invariants: every request received is admitted exactly once or aborted; no block is held
after `export` returns or `admit_ready` admits (the invariant checker finds no leak); a
request aborted while its blocks are written keeps them until the write is done, then gives
them back.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.engine.kv_transport import (
    KVTransferError,
    KVTransferMetrics,
    KVTransferParams,
    PayloadPuller,
    ready,
)
from kvcache.hashing import extra_key, prompt_block_hashes
from kvcache.transfer import BlockHold, abandon, adopt, hold_cached_prefix, release, reserve
from scheduler import RequestOutput, SamplingParams
from scheduler.lora import LoRARequest

if TYPE_CHECKING:
    from cluster.engine.llm_engine import LLMEngine

# An engine with only transfers to wait for sleeps this long between looks at them.
_IDLE_POLL_S = 0.005


@dataclass(slots=True)
class _Incoming:
    """A decode-side request waiting for its payloads."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None
    lora_request: LoRARequest | None
    transfer: KVTransferParams
    deadline: float
    pull: concurrent.futures.Future | None  # PayloadPuller's, when this process pulls

    def arrived(self) -> bool:
        """Whether the payloads are here (or known lost), without waiting."""
        return self.pull.done() if self.pull is not None else ready(self.transfer.payloads)


@dataclass(slots=True)
class _Writing:
    """A decode-side request whose fetched payloads are being written into its reserved
    blocks beside the steps; admitted once the write is done."""

    item: _Incoming
    hashes: list[bytes]
    cached: BlockHold
    fresh: BlockHold
    write: concurrent.futures.Future  # of the seconds the write took
    pulled_s: float
    aborted: bool = False


def prefill_sampling(params: SamplingParams) -> SamplingParams:
    """The prefill side's copy of a request's sampling parameters: the same first token (the
    same seed, penalties and logprobs), then done."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def _key(cache_salt: str | None, lora_request: LoRARequest | None) -> bytes | None:
    return extra_key(cache_salt, lora_request.cache_key if lora_request else None)


class KVTransfers:
    """One engine's transfers, either side (see the module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.role = engine.config.kv_role
        self.timeout_s = float(engine.config.kv_transfer_timeout_s)
        self.metrics = KVTransferMetrics()
        self._exports: dict[str, bytes | None] = {}  # request id -> its blocks' extra key
        self._incoming: dict[str, _Incoming] = {}
        self._writing: dict[str, _Writing] = {}
        # (Ray ranks pull their own payloads where they run: nothing to pull here)
        self._puller = None if engine.config.uses_ray else PayloadPuller()

    @property
    def pending(self) -> bool:
        """Decode-side requests not yet admitted (or aborted ones whose blocks are still
        being written)."""
        return bool(self._incoming) or bool(self._writing)

    def _require(self, role: str) -> None:
        if self.role != role:
            raise ValueError(f"this engine's kv_role is {self.role!r}; a request that "
                             f"{'exports' if role == 'prefill' else 'imports'} KV needs an "
                             f"engine started with kv_role {role!r}")

    # ----- prefill side ---------------------------------------------------------------

    def mark_export(self, request_id: str, params: SamplingParams, cache_salt: str | None,
                    lora_request: LoRARequest | None) -> None:
        """The request's prompt KV leaves when it finishes (ValueError unless it can)."""
        self._require("prefill")
        if params.n != 1 or params.max_tokens != 1:
            raise ValueError("a prefill request for a KV transfer runs with n=1 and "
                             f"max_tokens=1; got n={params.n}, max_tokens={params.max_tokens}")
        self._exports[request_id] = _key(cache_salt, lora_request)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Export the prompts of marked requests that just finished by length (a first
        token that ends the request leaves nothing to decode)."""
        for out in outputs:
            if not out.finished or out.request_id not in self._exports:
                continue
            key = self._exports.pop(out.request_id)
            done = out.outputs[0] if out.outputs else None
            if done is None or done.finish_reason != "length" or not done.token_ids:
                continue
            out.kv_transfer_params = self.export(out.prompt_token_ids, key, done.token_ids[-1])

    def export(self, prompt: list[int], key: bytes | None, first_token: int) -> KVTransferParams:
        """Hold the prompt's cached full blocks, copy them out on every rank, release them."""
        engine = self.engine
        kv = engine.scheduler.kv
        hold = hold_cached_prefix(kv, prompt_block_hashes(prompt, kv.block_size, key))
        start = time.perf_counter()
        try:
            handles, nbytes = (engine.executor.export_kv(hold.block_ids) if hold.blocks
                               else ([], 0))
        finally:
            num_blocks = len(hold.blocks)
            release(kv, hold)
        self.metrics.exports += 1
        self.metrics.bytes_out += nbytes
        self.metrics.seconds.observe(time.perf_counter() - start)
        return KVTransferParams(handles, num_blocks, kv.block_size,
                                engine.config.tensor_parallel_size, int(first_token), nbytes)

    def forget(self, request_id: str) -> bool:
        """An aborted request: nothing to export or import; whether it was waiting here."""
        self._exports.pop(request_id, None)
        writing = self._writing.get(request_id)
        if writing is not None:  # (its blocks go back once the write is done: admit_ready)
            writing.aborted = True
            return True
        item = self._incoming.pop(request_id, None)
        if item is not None and item.pull is not None:
            item.pull.cancel()
        return item is not None

    # ----- decode side ----------------------------------------------------------------

    def receive(self, request_id: str, prompt: list[int], params: SamplingParams,
                cache_salt: str | None, lora_request: LoRARequest | None,
                transfer: KVTransferParams) -> None:
        """Queue a request whose prompt KV arrives with `transfer` (ValueError unless it can)."""
        self._require("decode")
        cfg = self.engine.config
        if not isinstance(transfer, KVTransferParams):
            raise ValueError(f"kv_transfer_params must be the prefill engine's "
                             f"KVTransferParams; got {type(transfer).__name__}")
        if transfer.block_size != cfg.block_size:
            raise ValueError(f"the prefill engine's block_size is {transfer.block_size}, this "
                             f"decode engine's {cfg.block_size}; give both the same block_size")
        if (transfer.tensor_parallel_size != cfg.tensor_parallel_size
                or len(transfer.payloads) not in (0, cfg.tensor_parallel_size)):
            raise ValueError(f"the prefill engine runs tensor_parallel_size "
                             f"{transfer.tensor_parallel_size}, this decode engine "
                             f"{cfg.tensor_parallel_size}; KV is moved rank by rank, so give "
                             "both the same tensor_parallel_size")
        if transfer.num_blocks > len(prompt) // cfg.block_size:
            raise ValueError(f"kv_transfer_params covers {transfer.num_blocks} blocks; the "
                             f"prompt has only {len(prompt) // cfg.block_size} full blocks")
        if params.n != 1:
            raise ValueError(f"a request with KV transferred runs with n=1; got n={params.n}")
        if params.max_tokens is not None and params.max_tokens < 2:
            raise ValueError("the prefill side generated the only token max_tokens allows; "
                             "send a request with max_tokens >= 2 to the decode side")
        deadline = time.monotonic() + self.timeout_s
        pull = None if self._puller is None else self._puller.start(transfer.payloads, deadline)
        self._incoming[request_id] = _Incoming(request_id, list(prompt), params, cache_salt,
                                               lora_request, transfer, deadline, pull)

    def admit_ready(self) -> None:
        """Import the payloads that exist (or whose bound passed) and admit their requests.
        Call only with no plan in flight. With nothing else to do, waits a moment first."""
        if not self._incoming and not self._writing:
            return
        if not self.engine.scheduler.has_unfinished():
            time.sleep(_IDLE_POLL_S)  # (the loop would otherwise spin on empty steps)
        for writing in [w for w in self._writing.values() if w.write.done()]:
            del self._writing[writing.item.request_id]
            self._written(writing)
        now = time.monotonic()
        for item in list(self._incoming.values()):
            if now < item.deadline and not item.arrived():
                continue
            del self._incoming[item.request_id]
            if not self._import(item, now >= item.deadline):
                self._admit(item)

    def _admit(self, item: _Incoming) -> None:
        self.engine.queue_request(item.request_id, item.prompt, item.params, item.cache_salt,
                                  [item.transfer.first_token], item.lora_request)

    def _import(self, item: _Incoming, expired: bool) -> bool:
        """Write the payloads into this engine's blocks and cache them (see the docstring);
        on any failure count a fallback and leave the prompt to be computed. True when the
        write goes on beside the steps (the request is admitted once it is done)."""
        engine, transfer = self.engine, item.transfer
        kv = engine.scheduler.kv
        hashes = prompt_block_hashes(item.prompt[:transfer.num_blocks * kv.block_size],
                                     kv.block_size, _key(item.cache_salt, item.lora_request))
        if not hashes:
            return False
        if expired and not (item.pull is not None and item.pull.done()):
            self.metrics.fallbacks += 1
            return False
        payloads, pulled_s = transfer.payloads, 0.0
        if item.pull is not None:
            try:
                payloads, pulled_s = item.pull.result()
            except KVTransferError:
                self.metrics.fallbacks += 1
                return False
        start = time.perf_counter()
        try:
            cached, fresh = reserve(kv, hashes)
        except ValueError:  # no room now: computing the prompt needs the room anyway
            self.metrics.fallbacks += 1
            return False
        if fresh.blocks and item.pull is not None and self._puller is not None:
            # Fetched into this process: the write goes on while the next steps run. No plan
            # reads or writes the reserved blocks until `_written` admits the request.
            write = self._puller.write(engine.executor, fresh.block_ids, payloads,
                                       len(cached.blocks))
            if write is not None:
                self._writing[item.request_id] = _Writing(item, hashes, cached, fresh, write,
                                                          pulled_s)
                return True
        try:
            if fresh.blocks:
                engine.executor.import_kv(fresh.block_ids, payloads, len(cached.blocks),
                                          self.timeout_s)
        except KVTransferError:
            abandon(kv, cached, fresh)
            self.metrics.fallbacks += 1
            return False
        except BaseException:
            abandon(kv, cached, fresh)
            raise
        self._imported(item, hashes, cached, fresh, pulled_s + time.perf_counter() - start)
        return False

    def _written(self, writing: _Writing) -> None:
        """A write beside the steps is done: cache the blocks and admit the request (or, for
        a request aborted meanwhile, give the blocks back)."""
        kv = self.engine.scheduler.kv
        try:
            seconds = writing.write.result()
        except BaseException:
            abandon(kv, writing.cached, writing.fresh)
            raise
        if writing.aborted:
            abandon(kv, writing.cached, writing.fresh)
            return
        self._imported(writing.item, writing.hashes, writing.cached, writing.fresh,
                       writing.pulled_s + seconds)
        self._admit(writing.item)

    def _imported(self, item: _Incoming, hashes: list[bytes], cached: BlockHold,
                  fresh: BlockHold, seconds: float) -> None:
        transfer = item.transfer
        self.metrics.imports += 1
        self.metrics.bytes_in += transfer.nbytes * len(fresh.blocks) // transfer.num_blocks
        self.metrics.seconds.observe(seconds)
        adopt(self.engine.scheduler.kv, cached, fresh, hashes)

    def shutdown(self) -> None:
        """Stop pulling (the engine shuts down)."""
        if self._puller is not None:
            self._puller.shutdown()

    def stats(self) -> dict[str, Any]:
        """The role and the transfer metrics, for /metrics and `./dev status`."""
        return {"kv_role": self.role or "colocated", **self.metrics.as_dict(),
                "kv_transfers_waiting": len(self._incoming)}
