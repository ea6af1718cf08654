"""OpenAI batch lines for a pooling model: `url` /v1/embeddings, /v1/score or /v1/rerank (the
endpoints vLLM's run_batch takes besides chat), read and answered as the HTTP routes read and
answer them: the same request models, checks and input steps, and the same response bodies
(cluster/api/pooling_protocol.py, shared with cluster/api/pooling_api.py).

A line's body may hold several inputs (a list of texts, a rerank's documents): they ride in
one row as `pooling_inputs` (token id lists), each its own engine request in the engine stage,
and the row comes back with `pooled` (one vector per input, in order), so one line still gives
one output line.

Invariant: a line whose url names a task the model does not serve (an embedding of a
reranker, a score of a chat model) is answered as the HTTP route answers it, a 400 naming
`model`, as vLLM's run_batch answers each line of a mixed file by itself ("The model does not
support Embeddings API") rather than refusing the file.
"""

from __future__ import annotations

import json
from typing import Any

from cluster.api import pooling_protocol
from cluster.api.protocol import RequestError
from cluster.engine.pooling import PoolingInfo

EMBEDDINGS, SCORE, RERANK = "/v1/embeddings", "/v1/score", "/v1/rerank"
# url -> (the request model, the task it needs, the response id's prefix)
POOLING_URLS: dict[str, tuple[type, str, str]] = {
    EMBEDDINGS: (pooling_protocol.EmbeddingRequest, "embed", "embd"),
    SCORE: (pooling_protocol.ScoreRequest, "score", "score"),
    RERANK: (pooling_protocol.RerankRequest, "score", "rerank"),
}


def pooling_prompts(req: Any, url: str, pooling: PoolingInfo | None, served: str,
                    prompts: Any, max_model_len: int) -> list[list[int]]:
    """A parsed pooling body's engine inputs, each checked as the HTTP route checks it
    (`prompts`: the model's cluster.api.openai_prompts.PromptProcessor); RequestError
    naming the field otherwise."""
    _, task, _ = POOLING_URLS[url]
    info = pooling_protocol.check_task(pooling, task, url, served)
    req.check_options(max_model_len)
    if isinstance(req, pooling_protocol.EmbeddingRequest):
        req.check_embedding(info.pooler.normalize)
        try:
            info.check_dimensions(req.dimensions)
        except ValueError as e:
            raise RequestError(str(e), param="dimensions") from None
        inputs, param = pooling_protocol.embedding_inputs(req.input, prompts.tokenizer,
                                         req.add_special_tokens), "input"
    else:
        pairs, param = pooling_protocol.score_pairs_of(req)
        inputs = pooling_protocol.score_prompts(pairs, req, prompts.tokenizer)
    return [pooling_protocol.pooling_input(p, req, prompts, max_model_len, param) for p in inputs]


def pooling_body(row: dict[str, Any], model: str, pooling: PoolingInfo) -> dict[str, Any]:
    """The HTTP route's response body for a pooling row the engine stage answered."""
    kind, _, prefix = POOLING_URLS[row["url"]]
    req = kind.model_validate(json.loads(row["body"]))
    rid, vectors, prompts = f"{prefix}-{row['request_id']}", row["pooled"], row["pooling_inputs"]
    if isinstance(req, pooling_protocol.EmbeddingRequest):
        return pooling_protocol.embedding_body(rid, model, req, pooling, vectors, prompts)
    scores = [float(v[0]) for v in vectors]
    if isinstance(req, pooling_protocol.RerankRequest):
        return pooling_protocol.rerank_body(rid, model, req, scores, prompts)
    return pooling_protocol.score_body(rid, model, scores, prompts)
