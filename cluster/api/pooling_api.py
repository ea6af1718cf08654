"""The pooling routes: `/v1/embeddings` (OpenAI's), `/v1/score` and `/v1/rerank` (vLLM's),
served by an engine with the pooling runner (cluster/engine/pooling.py).

Each input is one engine request (a prefill that finishes with its last chunk), a body's
inputs sent in waves of the engine's max_num_seqs (what one step can hold; more at once would
only wait in Serve's queues, and beyond max_queued_requests turn the whole body into a 503) so
the engine batches them; the answer comes when every vector is in. Tokenizing a big body runs
off the event loop, as the generation routes do. A route asked of the other kind of model (an embedding of a reranker, a score of a chat
model, a generation of a pooling model) is a 400 naming `model`; every other client mistake a
400 naming its field: an empty input list or input, an input longer than a pooling request
may be (max_model_len tokens, after `truncate_prompt_tokens`), token ids outside the
vocabulary, `dimensions` the model does not declare. The bodies and what vLLM's options do
are cluster/api/pooling_protocol.py's.

Embeddings: `input` is a string, a list of strings, a list of token ids or a list of such
lists; strings are tokenized with the tokenizer's special tokens (`add_special_tokens`, true
by default), as vLLM does for pooling. `encoding_format` "base64" is each vector's float32
bytes in base64 (little-endian unless `endianness` asks otherwise: what the openai client
sends by default and decodes). Scores: Qwen3-Reranker's prompt template is
applied here (`rerank_prompt_ids`), `instruction` (vLLM has none; an extension) replacing its
default task line.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cluster.api.async_streams import aclose
from cluster.api.openai_errors import error_response, map_exception
from cluster.api.pooling_protocol import (
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    check_task,
    embedding_body,
    embedding_inputs,
    pooling_input,
    rerank_body,
    score_body,
    score_pairs_of,
    score_prompts,
)
from cluster.api.protocol import RequestError
from cluster.engine.pooling import PoolingInfo, pooling_params


def add_pooling_routes(app: FastAPI, serving: Any) -> None:
    """Register the three routes on the OpenAI app, over its OpenAIServing."""
    routes = PoolingRoutes(serving)
    app.add_api_route("/v1/embeddings", routes.embeddings, methods=["POST"])
    app.add_api_route("/v1/score", routes.score, methods=["POST"])
    app.add_api_route("/v1/rerank", routes.rerank, methods=["POST"])


class PoolingRoutes:
    """Handlers over the ingress's OpenAIServing (its model info, body limits, prompts)."""

    def __init__(self, serving: Any) -> None:
        self.serving = serving

    async def embeddings(self, request: Request) -> Response:
        rid = f"embd-{uuid.uuid4().hex}"
        try:
            info, pooling, size, req = await self._read(request, EmbeddingRequest, "embed")
            req.check_embedding(pooling.pooler.normalize)
            try:
                pooling.check_dimensions(req.dimensions)
            except ValueError as e:
                raise RequestError(str(e), param="dimensions") from None
            inputs = await self.serving._off_loop(size, embedding_inputs, req.input,
                                                  self.serving.prompts.tokenizer,
                                                  req.add_special_tokens)
            prompts = [pooling_input(p, req, self.serving.prompts, info.max_model_len, "input")
                       for p in inputs]
            vectors = await self._pool(prompts, req, info, rid)
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
            return error_response(map_exception(e, rid))
        return JSONResponse(embedding_body(rid, self.serving.served_model_name, req, pooling,
                                           vectors, prompts))

    async def score(self, request: Request) -> Response:
        rid = f"score-{uuid.uuid4().hex}"
        try:
            info, _, size, req = await self._read(request, ScoreRequest, "score")
            prompts, scores = await self._scores(req, info, size, rid)
        except Exception as e:  # noqa: BLE001
            return error_response(map_exception(e, rid))
        return JSONResponse(score_body(rid, self.serving.served_model_name, scores, prompts))

    async def rerank(self, request: Request) -> Response:
        rid = f"rerank-{uuid.uuid4().hex}"
        try:
            info, _, size, req = await self._read(request, RerankRequest, "score")
            prompts, scores = await self._scores(req, info, size, rid)
        except Exception as e:  # noqa: BLE001
            return error_response(map_exception(e, rid))
        return JSONResponse(rerank_body(rid, self.serving.served_model_name, req, scores,
                                        prompts))

    # ---- helpers -------------------------------------------------------------------------

    async def _read(self, request: Request, kind: type, task: str
                    ) -> tuple[Any, PoolingInfo, int, Any]:
        """The model's info, its PoolingInfo (400 unless it serves `task`), the body's size
        and the parsed body, its common options checked."""
        info, body, req = await self.serving._read(request, lambda _: kind)
        pooling = check_task(info.pooling, task, request.url.path,
                             self.serving.served_model_name)
        req.check_options(info.max_model_len)
        return info, pooling, len(body), req

    async def _scores(self, req: ScoreRequest | RerankRequest, info: Any, size: int, rid: str
                      ) -> tuple[list[list[int]], list[float]]:
        pairs, param = score_pairs_of(req)
        encoded = await self.serving._off_loop(size, score_prompts, pairs, req,
                                               self.serving.prompts.tokenizer)
        prompts = [pooling_input(p, req, self.serving.prompts, info.max_model_len, param)
                   for p in encoded]
        return prompts, [float(v[0]) for v in await self._pool(prompts, req, info, rid)]

    async def _pool(self, prompts: list[list[int]], req: PoolingRequest, info: Any,
                    rid: str) -> list[np.ndarray]:
        """Every prompt's pooled vector, sent to the engine max_num_seqs at a time."""
        wave = info.max_num_seqs or len(prompts)
        vectors: list[np.ndarray | None] = [None] * len(prompts)
        for lo in range(0, len(prompts), wave):
            part = prompts[lo:lo + wave]
            stream = self.serving._start(part, [pooling_params()] * len(part), f"{rid}-{lo}",
                                         req.cache_salt, pooling=True)
            try:
                async for idx, out in stream:
                    if out.pooled is not None:
                        vectors[lo + idx] = out.pooled
            finally:
                await aclose(stream)
        missing = [i for i, v in enumerate(vectors) if v is None]
        if missing:
            raise RuntimeError(f"the engine finished inputs {missing[:8]} without a vector")
        return vectors
