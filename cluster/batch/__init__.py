"""Batch jobs on Ray Data, built on the engine (never on the HTTP front).

- `build_processor(ProcessorConfig(...), preprocess, postprocess)`: stages over a
  `ray.data.Dataset` with engine replicas as an actor pool (processor.py, engine_stage.py);
- `python -m cluster.batch IN OUT` (`./dev batch`): OpenAI's batch file format in and out
  (openai_batch.py, __main__.py).
"""

from __future__ import annotations

from cluster.batch.config import ProcessorConfig
from cluster.batch.processor import Processor, build_processor

__all__ = ["ProcessorConfig", "Processor", "build_processor"]
