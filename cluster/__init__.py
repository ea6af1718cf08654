"""The serving layer, in two packages split at the seam between model and HTTP:

- `cluster.engine`: the engine, executors, offline `LLM`, config, metrics, output processing;
- `cluster.api`: the OpenAI HTTP API and the Ray Serve application
  (`serve run` names `cluster.api.serve_app:build_app`).

The engine never imports the API. `from cluster import LLM, SamplingParams` mirrors
`from vllm import LLM, SamplingParams`. Names load lazily so that importing a submodule
(e.g. the Serve app) stays cheap.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "LLM": "cluster.engine.llm",
    "RequestOutput": "cluster.engine.llm",
    "CompletionOutput": "cluster.engine.llm",
    "EngineConfig": "cluster.engine.config",
    "LLMEngine": "cluster.engine.llm_engine",
    "AsyncLLMEngine": "cluster.engine.async_llm_engine",
    "EngineDeadError": "cluster.engine.errors",
    "SamplingParams": "scheduler.sampling_params",
    "LoRARequest": "scheduler.lora",
    "StructuredOutputsParams": "scheduler.sampling_params",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cluster' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
