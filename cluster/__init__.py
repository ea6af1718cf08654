"""The engine, executors, offline `LLM` and the Ray Serve application.

`from cluster import LLM, SamplingParams` mirrors `from vllm import LLM, SamplingParams`.
Names load lazily so that importing a submodule (e.g. the Serve app) stays cheap.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "LLM": "cluster.llm",
    "RequestOutput": "cluster.llm",
    "CompletionOutput": "cluster.llm",
    "EngineConfig": "cluster.config",
    "LLMEngine": "cluster.engine",
    "AsyncLLMEngine": "cluster.engine",
    "EngineDeadError": "cluster.engine",
    "SamplingParams": "scheduler.sampling_params",
    "StructuredOutputsParams": "scheduler.sampling_params",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cluster' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
