"""`build_processor`: a batch job's stages over a `ray.data.Dataset`, in the shape of Ray Data
LLM's `build_llm_processor`.

    preprocess (row map) -> chat template -> tokenize -> engine (actor pool) -> postprocess

Rows are dicts: `messages` (a chat) or `prompt` (text) or `prompt_token_ids`, an optional
`sampling_params` dict (SamplingParams' fields; what it leaves out takes the model's
generation_config defaults), and any other columns, which pass through. Out come the engine
stage's columns (`generated_text`, `generated_tokens`, `finish_reason`, token counts; see
engine_stage.OUTPUT_COLUMNS) and `error` (None for good rows). With a pooling engine
(`engine_kwargs` `runner: pooling`, or "auto" on an embedding or reranker checkpoint) a
`prompt` or `prompt_token_ids` row gets `embeddings` (the embed task: Ray Data LLM's column)
or `score` (a reranker's P(yes) of a prompt already in its template) instead, and prompts
are tokenized with the tokenizer's special tokens, as LLM.embed does. Text comes from the engine's
own incremental detokenizer (the one that matches stop strings), so Ray Data LLM's separate
detokenize stage has no work here. Progress is Ray Data's own progress bars, one per stage.
The chat template and tokenizer run as tasks (a fraction of a CPU each); the engine stage is
an actor pool whose actors Ray restarts when their process dies (engine_stage.py).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

from cluster.batch.config import ProcessorConfig
from cluster.batch.engine_stage import EngineStage
from cluster.batch.stages import apply_chat_template, engine_pooling, tokenize

Row = dict[str, Any]


class Processor:
    """A built job: `processor(ds)` is the output dataset (lazy, like every Ray Data step)."""

    def __init__(self, config: ProcessorConfig, preprocess: Callable[[Row], Row] | None,
                 postprocess: Callable[[Row], Row] | None) -> None:
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess

    def __call__(self, ds: Any) -> Any:
        import ray.data

        cfg = self.config
        model = cfg.engine_config().model
        # The row stages run as at most `tokenizer_concurrency` tasks at a time, so that
        # few worker processes each load the tokenizer once (Ray fuses these stages).
        task = dict(num_cpus=cfg.tokenizer_num_cpus, concurrency=cfg.tokenizer_concurrency)
        if self.preprocess is not None:
            ds = ds.map(self.preprocess, **task)
        task.update(batch_format="pyarrow", batch_size=cfg.batch_size)
        if cfg.apply_chat_template:
            ds = ds.map_batches(functools.partial(
                apply_chat_template, model=model, chat_template_kwargs=cfg.chat_template_kwargs),
                **task)
        if cfg.tokenize:
            pooling = engine_pooling(cfg.engine_config()) is not None
            ds = ds.map_batches(functools.partial(tokenize, model=model,
                                                  add_special_tokens=pooling), **task)
        # One batch per block: an actor's task takes a block and runs its batches one after
        # another, so bigger blocks would put batches of a block in line behind each other.
        ds = ds.repartition(target_num_rows_per_block=cfg.batch_size)
        low, high = cfg.pool_size
        in_flight = cfg.max_batches_in_flight
        pool = ray.data.ActorPoolStrategy(min_size=low, max_size=high,
                                          max_tasks_in_flight_per_actor=in_flight,
                                          max_concurrent_calls_per_actor=in_flight)
        with warnings.catch_warnings():
            # Ray 2.60 deprecates passing actor options this way and names no replacement
            # for these two; Ray Data's defaults (-1: restart forever, retry forever) are
            # what remains when it goes. A finite max_restarts stops a batch that kills
            # every engine it reaches from running forever.
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            ds = ds.map_batches(
                EngineStage, fn_constructor_kwargs={"engine_kwargs": dict(cfg.engine_kwargs)},
                batch_format="pyarrow", batch_size=cfg.batch_size, num_cpus=cfg.engine_num_cpus,
                num_gpus=cfg.engine_gpus(ray.cluster_resources().get("GPU", 0)), compute=pool, max_restarts=cfg.max_restarts, max_task_retries=-1)
        if self.postprocess is not None:
            ds = ds.map(self.postprocess, num_cpus=cfg.tokenizer_num_cpus,
                        concurrency=cfg.tokenizer_concurrency)
        return ds


def build_processor(config: ProcessorConfig, preprocess: Callable[[Row], Row] | None = None,
                    postprocess: Callable[[Row], Row] | None = None) -> Processor:
    """The job's stages for `config` (ray.data.llm.build_llm_processor's arguments)."""
    if not isinstance(config, ProcessorConfig):
        raise ValueError(f"config must be a cluster.batch.ProcessorConfig; got "
                         f"{type(config).__name__}")
    for name, fn in (("preprocess", preprocess), ("postprocess", postprocess)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a function of one row (a dict) or None; got "
                             f"{type(fn).__name__}")
    return Processor(config, preprocess, postprocess)
