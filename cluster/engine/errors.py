"""The engine's failures that reach its callers: the API maps each to an HTTP status.

Plain exception types with no imports, so the HTTP layer can catch them without loading the
engine (and torch). A worker's own death is the executor's `WorkerDiedError`: the engine
handles it (rebuild, recompute) and only its outcome arrives here.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more requests (a worker died); the replica must be replaced."""


class EngineStalledError(EngineDeadError):
    """The engine loop has made no step for engine_stall_timeout_s while it had requests: the
    replica fails its health check and is replaced; its requests resume on another one."""


class EngineRecoveringError(RuntimeError):
    """A worker died and the engine is rebuilding its tensor-parallel group (not ready yet)."""


class OverloadedError(RuntimeError):
    """The engine's waiting queue is full; retry later (HTTP 429)."""
