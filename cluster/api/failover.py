"""Resuming a request on another LLMServer replica when the one serving it is lost.

A replica is lost to a request when its actor dies (killed, its node gone, or stopped by Serve
after `graceful_shutdown_timeout_s` of draining) or when its engine is dead (EngineDeadError:
Serve replaces such a replica at its next health check); a draining replica (scale-down, a
redeploy, a failed health check) hands its unfinished requests over before Serve kills it
(ReplicaDrainingError, cluster/api/drain.py). The ingress then asks the deployment again, through the same router, with the tokens
the request has generated so far (`resume_token_ids`): the new replica recomputes prompt plus
those tokens and goes on sampling from the same output index (LLMEngine.add_request), so a
greedy or seeded request produces exactly the tokens it would have, and its client sees one
request: deltas continue with nothing repeated or lost, usage counts the original prompt and
every output token once.

Invariants: a stream is resumed only between two deltas (a delta is never half delivered);
only a request with n == 1 is resumed (its tokens are one list; a request with n > 1 fails as
before, with the engine's error); a request is resumed for at most RESUME_WINDOW_S after its
replica was lost, so a deployment with no replica left ends the request with an error (a
503 body, or an OpenAI error event in a stream), never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray.exceptions import RayActorError

from cluster.api.async_streams import aclose
from cluster.engine.errors import EngineDeadError

logger = logging.getLogger("ray.serve")

# How long a request keeps trying surviving replicas after its own was lost: room for Serve to
# notice a dead replica and route elsewhere (or to start a new one when it was the last).
RESUME_WINDOW_S = 60.0
# Pause before each new attempt, doubling up to the cap: a dead replica the router has not yet
# dropped answers at once, and a tight loop would spend the window in a few milliseconds.
RESUME_BACKOFF_S = 0.1
RESUME_BACKOFF_MAX_S = 2.0

OpenStream = Callable[[list[int]], AsyncIterator[Any]]


class ReplicaDrainingError(RuntimeError):
    """The replica serving a request is being stopped and handed the request over."""


def replica_lost(e: BaseException) -> bool:
    """Whether `e`, raised by a replica's stream, means that replica cannot go on with the
    request (but another one can): its actor died or is unreachable, or its engine is dead."""
    if isinstance(e, (RayActorError, EngineDeadError, ReplicaDrainingError)):
        return True
    cause = getattr(e, "cause", None)  # a RayTaskError wrapping the replica's exception
    if isinstance(cause, BaseException) and cause is not e:
        return replica_lost(cause)
    # A gRPC stream from a replica whose process is gone, before Serve maps it to
    # ActorUnavailableError (Serve's direct channel, replica_result.py).
    code = getattr(e, "code", None)
    if type(e).__module__.startswith("grpc") and callable(code):
        return getattr(code(), "name", "") in ("UNAVAILABLE", "CANCELLED", "UNKNOWN", "INTERNAL")
    return False


async def resuming_stream(open_stream: OpenStream, request_id: str, n: int) -> AsyncIterator[Any]:
    """`open_stream(resume_token_ids)`'s RequestOutput deltas, reopened with the tokens
    generated so far whenever the replica behind it is lost (see the module docstring)."""
    generated: list[int] = []
    lost_at: float | None = None
    backoff = RESUME_BACKOFF_S
    while True:
        stream = open_stream(list(generated))
        try:
            async for out in stream:
                lost_at, backoff = None, RESUME_BACKOFF_S
                for comp in out.outputs:
                    generated.extend(comp.token_ids)
                yield out
                if out.finished:
                    return
            return
        except Exception as e:  # noqa: BLE001 - resumed or re-raised
            now = time.monotonic()
            lost_at = now if lost_at is None else lost_at
            if n != 1 or not replica_lost(e) or now - lost_at > RESUME_WINDOW_S:
                raise
            if isinstance(e, ReplicaDrainingError):
                logger.info("request %s: handed over by its draining replica after %d tokens; "
                            "resuming on another replica", request_id, len(generated))
            else:
                logger.warning("request %s: its replica was lost after %d tokens (%s: %s); "
                               "resuming on another replica", request_id, len(generated),
                               type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        finally:
            await aclose(stream)
        await asyncio.sleep(backoff)
        backoff = min(2 * backoff, RESUME_BACKOFF_MAX_S)
