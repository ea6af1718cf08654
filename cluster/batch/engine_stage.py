"""The engine stage: one `AsyncLLMEngine` per actor of a Ray Data actor pool.

Ray Data hands an actor up to `max_batches_in_flight` batches at once; every row of each is
its own request in the one engine, so the engine's slots are refilled from the next batch as
rows of the last one finish (continuous batching across batches, not batch-synchronous). A
batch is returned only when all its rows are done: a batch is the unit Ray retries, and a
partial batch once returned could not be taken back.

Invariants: every row comes out exactly once, either with the engine's output or with its
`error` (bad sampling parameters, a prompt too long for the context: the engine's
`ValueError`), never both. When the engine can no longer serve (EngineDeadError: its loop
failed, a rebuild of its tensor-parallel workers failed, or it stalled for
engine_stall_timeout_s) the actor's process exits instead of waiting on it forever (the hang
of ray#59986): Ray restarts the actor (`max_restarts`) and runs its unfinished batches again
(`max_task_retries`), so no row is lost and none is returned twice.

A pooling engine (`runner: pooling`) pools instead of generating: a row's `prompt_token_ids`
become its `embeddings` (the embed task) or `score` (a reranker's P(yes)) column, the columns
Ray Data LLM's embedding task writes; an OpenAI batch line's several inputs
(`pooling_inputs`) become `pooled`, one vector per input. Each input is its own engine
request, so they batch with every other row's. A row asking for sampling on a pooling engine
is that row's error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import uuid
from typing import Any

import pyarrow as pa

from cluster.batch.stages import columns_of, rows_of
from cluster.engine.async_llm_engine import AsyncLLMEngine
from cluster.engine.config import EngineConfig
from cluster.engine.errors import EngineDeadError
from cluster.engine.pooling import check_pooling_input, pooling_params
from scheduler.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# How often a busy actor checks that its engine still makes progress.
_WATCHDOG_SECONDS = 2.0
OUTPUT_COLUMNS = ("request_id", "generated_text", "generated_tokens", "num_input_tokens",
                  "num_generated_tokens", "num_cached_tokens", "finish_reason", "stop_reason")
POOLING_COLUMNS = ("request_id", "num_input_tokens")  # and `embeddings` / `score` / `pooled`


def sampling_params(value: dict[str, Any] | str | None,
                    defaults: dict[str, Any]) -> SamplingParams:
    """A row's `sampling_params` (a dict, or its JSON text) over the engine's defaults (the
    model's generation_config, as the HTTP API applies them). Null values count as left out:
    Arrow fills the keys other rows of a column set with null. `logit_bias` keys are token
    ids, as integers or strings (OpenAI's JSON)."""
    given = json.loads(value) if isinstance(value, str) else dict(value or {})
    given = {k: v for k, v in given.items() if v is not None}
    unknown = sorted(set(given) - _FIELDS)
    if unknown:
        raise ValueError(f"sampling_params: unknown field(s) {unknown}; valid ones: "
                         f"{sorted(_FIELDS)}")
    if given.get("n", 1) != 1:
        raise ValueError(f"sampling_params.n is {given['n']}; a batch row asks for one "
                         "completion (repeat the row for more)")
    bias = given.get("logit_bias")
    if isinstance(bias, dict):
        try:
            given["logit_bias"] = {int(k): v for k, v in bias.items() if v is not None}
        except ValueError:
            raise ValueError(f"sampling_params.logit_bias keys are token ids; got "
                             f"{sorted(bias)}") from None
    so = given.get("structured_outputs")
    if isinstance(so, dict):
        try:
            given["structured_outputs"] = StructuredOutputsParams(
                **{k: v for k, v in so.items() if v is not None})
        except TypeError as e:
            raise ValueError(f"sampling_params.structured_outputs: {e}") from None
    return SamplingParams(**{**defaults, **given})


class EngineStage:
    """A Ray Data callable class: batches of rows with `prompt_token_ids` in, the same rows
    with the OUTPUT_COLUMNS (a pooling engine: POOLING_COLUMNS and its vectors) and `error`
    out."""

    def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        self.engine = AsyncLLMEngine(EngineConfig.from_dict(engine_kwargs))
        self._watchdog: asyncio.Task | None = None

    async def __call__(self, batch: pa.Table) -> dict[str, list[Any]]:
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        rows = rows_of(batch)
        run = self._generate if self.engine.pooling is None else self._pool
        await asyncio.gather(*(run(row) for row in rows))
        return columns_of(rows)

    async def _pool(self, row: dict[str, Any]) -> None:
        many = row.get("pooling_inputs")
        inputs = many if many is not None else [row.get("prompt_token_ids") or []]
        out = "pooled" if many is not None else {"embed": "embeddings"}.get(
            self.engine.pooling.task, "score")
        row.update(dict.fromkeys((*POOLING_COLUMNS, out)),
                   num_input_tokens=sum(map(len, inputs)))
        if row.get("error"):
            return
        row["error"] = None
        request_id = uuid.uuid4().hex
        try:
            if row.get("sampling_params") is not None:
                raise ValueError("sampling_params: this engine runs the pooling runner "
                                 "(embeddings, scores) and samples nothing; leave it out")
            for ids in inputs:
                check_pooling_input(ids, self.engine.max_model_len, "prompt_token_ids")
            vectors = await asyncio.gather(*(self._pool_one(list(ids), f"{request_id}-{i}")
                                             for i, ids in enumerate(inputs)))
        except EngineDeadError as e:
            self._exit(e)
        except ValueError as e:  # this row's input
            row["error"] = str(e)
            return
        missing = [i for i, v in enumerate(vectors) if v is None]
        if missing:
            row["error"] = f"the engine finished inputs {missing[:8]} without a vector"
            return
        row["request_id"] = request_id
        if out == "pooled":
            row[out] = [v.tolist() for v in vectors]
        else:
            row[out] = vectors[0].tolist() if out == "embeddings" else float(vectors[0][0])

    async def _pool_one(self, ids: list[int], request_id: str) -> Any:
        """The input's pooled vector (None if the engine finished it without one)."""
        pooled = None
        async for delta in self.engine.generate(ids, pooling_params(), request_id):
            if delta.pooled is not None:
                pooled = delta.pooled
        return pooled

    async def _generate(self, row: dict[str, Any]) -> None:
        ids = row.get("prompt_token_ids")
        row.update(dict.fromkeys(OUTPUT_COLUMNS), num_input_tokens=len(ids or ()))
        if row.get("error"):
            return
        row["error"] = None
        request_id = uuid.uuid4().hex
        text, tokens = [], []
        try:
            params = sampling_params(row.get("sampling_params"), self.engine.default_sampling)
            async for delta in self.engine.generate(list(ids or ()), params, request_id):
                out = delta.outputs[0]
                text.append(out.text)
                tokens.extend(out.token_ids)
                row["num_cached_tokens"] = delta.num_cached_tokens
                if out.finish_reason is not None:
                    row["finish_reason"], row["stop_reason"] = out.finish_reason, out.stop_reason
        except EngineDeadError as e:
            self._exit(e)
        except (ValueError, TypeError) as e:  # this row's parameters or prompt
            row["error"] = str(e)
            return
        row.update(request_id=request_id, generated_text="".join(text), generated_tokens=tokens,
                   num_generated_tokens=len(tokens))

    async def _watch(self) -> None:
        """Exit once the engine can no longer serve, even if no request notices (a stall)."""
        while True:
            await asyncio.sleep(_WATCHDOG_SECONDS)
            try:
                self.engine.check_health()
            except EngineDeadError as e:
                self._exit(e)

    def _exit(self, error: BaseException) -> None:
        # The process, not the actor: an intentional exit_actor() is not restarted, and the
        # batches in flight would fail instead of running again on the restarted actor.
        logger.error("batch engine actor: the engine cannot serve (%s); exiting so Ray restarts "
                     "this actor and retries its unfinished batches", error)
        self._shutdown()  # its workers' placement group, for the restarted actor to take
        os._exit(1)

    def _shutdown(self) -> None:
        try:
            self.engine.shutdown()
        except Exception as e:  # noqa: BLE001 - the engine is already broken; say so, go on
            logger.warning("batch engine actor: shutting the engine down failed: %s", e)

    def __del__(self) -> None:
        # Ray Data drops the UDF when the job ends (a graceful actor exit): a tp > 1 engine's
        # workers and placement group go with it rather than with the driver. (An actor
        # killed outright leaves them to its owner: the driver's job.)
        self._shutdown()
