"""The drain hand-off: an LLMServer replica that Serve is stopping hands its unfinished
requests to another replica instead of having them cut.

Serve stops a replica (scale-down, a redeploy, a failed health check) by draining it: its routers stop sending it requests, the controller waits up to the deployment's
`graceful_shutdown_timeout_s` for its ongoing requests, then kills it. Serve tells user code
only at the end (`__del__`), so a request longer than the timeout used to be cut by the kill
and resumed by the ingress's failover as if the replica had crashed (cluster/api/failover.py).

Here the hand-off is explicit. `watch_drain(callback)` calls `callback(timeout_s)` when Serve
begins this replica's graceful shutdown (Serve has no hook for that: a wrapper around its
`Replica.perform_graceful_shutdown`, installed once per process; a Ray without that method gets
a warning and the old behaviour). `Drain` is what the replica then does:
- it admits nothing more: a request that still reaches it is handed over before its first token;
- its requests run on for HANDOFF_AFTER (a half) of graceful_shutdown_timeout_s: what
  finishes by then finishes here;
- the rest are handed over: the engine aborts each (its blocks are free within a step) and its
  stream ends with HANDOFF after its last whole delta; the ingress resumes it on another replica
  from the tokens it has (failover.py), at once instead of after a kill.

Invariants: a handed-over request's client has exactly the deltas sent before HANDOFF (the
abort drops what a step in flight produces for it); a request with n > 1 is never handed over
(its tokens are not one list to resume from): it runs until the kill, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

logger = logging.getLogger("ray.serve")

# A stream's last item when its request goes on elsewhere (a packed output is a 5-tuple).
HANDOFF: tuple = ("handoff",)
# Hand over after this part of graceful_shutdown_timeout_s. The rest is the margin before the
# controller's kill, counted from when it began the stop: for Serve's call to reach a replica
# whose event loop runs the model (in-process on CPU; 2-3 s late on the loaded 2-core test
# machine), then for the aborts and the ends of the streams to reach the ingress.
HANDOFF_AFTER = 0.5

_callbacks: list[Callable[[float], None]] = []


def watch_drain(callback: Callable[[float], None]) -> bool:
    """Call `callback(graceful_shutdown_timeout_s)` when Serve begins stopping this replica
    (possibly more than once). False where this Ray's Serve cannot say so."""
    from ray.serve._private import replica

    cls = getattr(replica, "Replica", None)
    original = getattr(cls, "perform_graceful_shutdown", None)
    if cls is None or original is None:
        logger.warning("Serve has no Replica.perform_graceful_shutdown here: a stopping "
                       "replica's requests resume elsewhere after it is killed, not before")
        return False
    if not getattr(original, "runs_drain_callbacks", False):
        async def perform_graceful_shutdown(self: Any) -> None:
            config = getattr(self, "_deployment_config", None)
            timeout_s = float(getattr(config, "graceful_shutdown_timeout_s", 0.0))
            for cb in list(_callbacks):
                try:
                    cb(timeout_s)
                except Exception:  # noqa: BLE001 - Serve's own shutdown must go on
                    logger.exception("a drain callback failed")
            await original(self)

        perform_graceful_shutdown.runs_drain_callbacks = True  # type: ignore[attr-defined]
        cls.perform_graceful_shutdown = perform_graceful_shutdown
    _callbacks.append(callback)
    return True


class Drain:
    """One replica's requests and whether it is draining (see the module docstring).
    `abort(request_id)` must end that request's stream with asyncio.CancelledError after
    the deltas already given to it (AsyncLLMEngine.abort does)."""

    def __init__(self, abort: Callable[[str], Awaitable[None]]) -> None:
        self._abort = abort
        self.draining = False
        self._active: set[str] = set()  # requests with n == 1 streaming from here
        self._handed_over: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    def begin(self, timeout_s: float) -> None:
        """Serve began stopping this replica and kills it `timeout_s` from now. Any thread."""
        if self._loop is None:  # never served: nothing to hand over
            self.draining = True
            return
        self._loop.call_soon_threadsafe(self._start, timeout_s)

    def _start(self, timeout_s: float) -> None:
        if self._task is not None:
            return
        self.draining = True
        self._task = asyncio.ensure_future(
            self._hand_over_after(HANDOFF_AFTER * timeout_s))

    async def _hand_over_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if self._active:
            logger.warning("draining: handing %d unfinished requests to other replicas",
                           len(self._active))
        for request_id in list(self._active):
            self._handed_over.add(request_id)
            await self._abort(request_id)

    async def stream(self, request_id: str, n: int,
                     deltas: Callable[[], AsyncIterator[Any]]) -> AsyncIterator[Any]:
        """`deltas()`, or HANDOFF first (draining) or last (handed over meanwhile)."""
        self._loop = self._loop or asyncio.get_running_loop()
        if self.draining and n == 1:
            yield HANDOFF
            return
        if n == 1:
            self._active.add(request_id)
        try:
            async for item in deltas():
                yield item
        except asyncio.CancelledError:
            if request_id not in self._handed_over:
                raise
            yield HANDOFF
        finally:
            self._active.discard(request_id)
            self._handed_over.discard(request_id)
