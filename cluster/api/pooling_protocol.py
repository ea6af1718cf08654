"""The pooling routes' request bodies (vLLM's fields for /v1/embeddings, /v1/score and
/v1/rerank) and what their options do to an input.

Every field vLLM's pooling protocol declares is either done here or refused with a 400
naming it; a field it does not declare is a 400 too (extra="forbid"). Nothing is ignored
unless it cannot change the output (`user`, `request_id`).

Done:
- `truncate_prompt_tokens` (all three): k >= 1 keeps k tokens of each input, the last k
  (`truncation_side` "left", vLLM's default) or the first k ("right"); -1 is max_model_len;
  0, below -1 or above max_model_len is a 400. A score or rerank input is the whole templated
  prompt of its pair (its end, the reranker's judged position, kept by "left").
- `cache_salt`: salts the prefix cache's hashes, as on the generation routes.
- `priority` 0 (this server has no priority scheduling: any other value is a 400, as vLLM
  answers without it); `padding` "do_not_pad"; `mm_processor_kwargs` empty (text models).
- Embeddings: `add_special_tokens` (default true), `embed_dtype` "float32", `endianness` of
  base64 vectors ("native" is this host's byte order), `use_activation` (the normalization:
  true normalizes a model whose pooler does not; false is a 400 on a model whose pooler
  does, since the raw vector never leaves the workers).
- Scores: `use_activation` true (the reranker's P(yes) is the activation); false is a 400.
- Rerank `query` and `documents` as vLLM's content objects, `{"content": [{"type": "text",
  "text": ...}, ...]}`: text parts, joined with newlines; another part type is a 400 (a
  text-only model). The result's `document` is `{"text": ...}` for a string and
  `{"multi_modal": content}` for an object, vLLM's RerankDocument.

Refused (400 naming the field): `normalize` (vLLM removed it for `use_activation`),
`embed_dtype` other than float32, `encoding_format` "bytes", `padding` "max_length", and vLLM's
chat-style embedding inputs (`messages`) and newer score aliases (`queries`, `items`,
`data_1`), which are undeclared fields here.

The steps between a parsed body and the engine (which inputs, their checks) and the response
bodies are functions here, so the HTTP routes (pooling_api.py) and the batch files
(cluster/batch/pooling_batch.py) read and answer a body the same way.
"""

from __future__ import annotations

import base64
import sys
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from cluster.api.protocol import RequestError
from cluster.engine.pooling import PoolingInfo, check_pooling_input, rerank_prompt_ids, score_pairs


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class ContentInput(BaseModel):
    """vLLM's ScoreMultiModalParam: an input given as content parts."""

    model_config = ConfigDict(extra="forbid", strict=True)

    content: list[ContentPart]


class PoolingRequest(BaseModel):
    """Fields every pooling route takes (vLLM's PoolingBasicRequestMixin)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    user: str | None = None  # (cannot change the output)
    request_id: str | None = None  # (cannot change the output; the response has its own id)
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: int = 0
    cache_salt: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    use_activation: bool | None = None
    normalize: Any = None  # vLLM removed it: refused with its message

    def check_options(self, max_model_len: int) -> None:
        """400 for an option this server refuses or a value out of its range."""
        if self.normalize is not None:
            raise RequestError("Parameter `normalize` was removed; use `use_activation` "
                               "instead", param="normalize")
        if self.priority != 0:
            raise RequestError(f"priority={self.priority}: this server has no priority "
                               "scheduling; leave priority 0", param="priority")
        if self.mm_processor_kwargs:
            raise RequestError("mm_processor_kwargs: this model is text-only; leave it out",
                               param="mm_processor_kwargs")
        if self.padding == "max_length":
            raise RequestError("padding 'max_length' is for fixed-length encoders; this "
                               "model takes inputs as they are ('do_not_pad')", param="padding")
        limit = self.truncate_prompt_tokens
        if limit is not None and (limit == 0 or limit < -1 or limit > max_model_len):
            raise RequestError(f"truncate_prompt_tokens must be -1 (max_model_len) or 1 to "
                               f"max_model_len ({max_model_len}); got {limit}",
                               param="truncate_prompt_tokens")

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        """`ids` as truncate_prompt_tokens and truncation_side keep them."""
        limit = self.truncate_prompt_tokens
        if limit is None:
            return ids
        keep = max_model_len if limit == -1 else limit
        if len(ids) <= keep:
            return ids
        return ids[:keep] if self.truncation_side == "right" else ids[len(ids) - keep:]


class EmbeddingRequest(PoolingRequest):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    add_special_tokens: bool = True
    embed_dtype: str = "float32"
    endianness: Literal["native", "little", "big"] = "native"

    def check_embedding(self, normalizes: bool) -> None:
        """400 for an embedding option this server refuses (`normalizes`: the model's pooler
        normalizes its vectors)."""
        if self.embed_dtype != "float32":
            raise RequestError(f"embed_dtype {self.embed_dtype!r}: this server encodes float32 "
                               "only; leave it out", param="embed_dtype")
        if self.use_activation is False and normalizes:
            raise RequestError("use_activation false asks for the vector before its "
                               "normalization, which this model's pooler applies in the "
                               "workers; leave it out", param="use_activation")

    def base64_dtype(self) -> str:
        """numpy's float32 dtype string in the byte order `endianness` asks for."""
        order = {"little": "<", "big": ">"}.get(self.endianness,
                                                "<" if sys.byteorder == "little" else ">")
        return order + "f4"


class ScoreRequest(PoolingRequest):
    """vLLM's /v1/score: `text_1` against each of `text_2`, or two lists pairwise."""

    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None


class RerankRequest(PoolingRequest):
    """vLLM's (Jina's, Cohere's) /v1/rerank."""

    query: str | ContentInput
    documents: list[str | ContentInput]
    top_n: int | None = None  # None or 0: every document
    instruction: str | None = None

    def texts(self) -> tuple[str, list[str]]:
        """The query's and each document's text (400 for a part that is not text)."""
        return (_text(self.query, "query"),
                [_text(d, "documents") for d in self.documents])

    def document(self, i: int) -> dict[str, Any]:
        """Result i's `document`, as vLLM's RerankDocument."""
        doc = self.documents[i]
        if isinstance(doc, str):
            return {"text": doc}
        return {"multi_modal": [p.model_dump(exclude_none=True) for p in doc.content]}


def check_score_activation(req: PoolingRequest) -> None:
    """400 for use_activation false on a score route (the raw yes/no logit never leaves the
    workers; P(yes) is the activation)."""
    if req.use_activation is False:
        raise RequestError("use_activation false asks for the raw logit; this server returns "
                           "the reranker's P(yes); leave it out", param="use_activation")


def _text(value: str | ContentInput, param: str) -> str:
    if isinstance(value, str):
        return value
    if not value.content:
        raise RequestError(f"{param}: a content object needs at least one part", param=param)
    for part in value.content:
        if part.type != "text" or part.text is None:
            raise RequestError(f"{param}: content part type {part.type!r} is not supported; "
                               "this model is text-only: send {\"type\": \"text\", \"text\": "
                               "...} parts or strings", param=param)
    return "\n".join(p.text for p in value.content if p.text is not None)


# ---- from a parsed body to the engine's inputs ---------------------------------------------

def check_task(pooling: PoolingInfo | None, task: str, route: str, served: str) -> PoolingInfo:
    """The model's PoolingInfo; 400 naming `model` unless it is a pooling model serving
    `task` ("embed" or "score") that `route` asks for."""
    if pooling is None or pooling.task != task:
        serves = "text generation" if pooling is None else f"the {pooling.task!r} task"
        raise RequestError(f"{route} needs a pooling model serving the {task!r} task; "
                           f"`{served}` serves {serves}", param="model")
    return pooling


def embedding_inputs(value: Any, tokenizer: Any, add_special_tokens: bool) -> list[list[int]]:
    """An embedding body's `input` as token id lists (strings through `tokenizer`)."""
    if isinstance(value, str):
        value = [value]
    if not value:
        raise RequestError("input is an empty list; send at least one input", param="input")
    if isinstance(value[0], int):
        return [list(value)]
    return [tokenizer(v, add_special_tokens=add_special_tokens)["input_ids"]
            if isinstance(v, str) else list(v) for v in value]


def score_pairs_of(req: ScoreRequest | RerankRequest) -> tuple[list[tuple[str, str]], str]:
    """A score or rerank body's (query, document) pairs and the field that holds the
    documents; 400 for an option out of range or no document."""
    check_score_activation(req)
    if isinstance(req, RerankRequest):
        if req.top_n is not None and req.top_n < 0:
            raise RequestError(f"top_n must be >= 0 (0: every document); got {req.top_n}",
                               param="top_n")
        query, documents = req.texts()
        pairs, param = [(query, d) for d in documents], "documents"
    else:
        try:
            pairs, param = score_pairs(req.text_1, req.text_2), "text_2"
        except ValueError as e:
            raise RequestError(str(e), param="text_2") from None
    if not pairs:
        raise RequestError(f"{param} is an empty list; send at least one document", param=param)
    return pairs, param


def score_prompts(pairs: list[tuple[str, str]], req: ScoreRequest | RerankRequest,
                  tokenizer: Any) -> list[list[int]]:
    """Each pair's Qwen3-Reranker prompt (`instruction` replacing the default task line)."""
    return [rerank_prompt_ids(tokenizer, q, d, req.instruction) for q, d in pairs]


def pooling_input(ids: list[int], req: PoolingRequest, prompts: Any, max_model_len: int,
                  param: str) -> list[int]:
    """`ids` truncated as the request asks, then checked as a pooling input (`prompts`: the
    model's cluster.api.openai_prompts.PromptProcessor, for the vocabulary check)."""
    ids = req.truncate(ids, max_model_len)
    prompts.check_ids(ids, param)
    try:
        check_pooling_input(ids, max_model_len, param)
    except ValueError as e:
        raise RequestError(str(e), param=param) from None
    return ids


# ---- response bodies -------------------------------------------------------------------------

def usage(prompts: Sequence[Sequence[int]]) -> dict[str, int]:
    n = sum(len(p) for p in prompts)
    return {"prompt_tokens": n, "total_tokens": n}


def embedding_body(rid: str, model: str, req: EmbeddingRequest, pooling: PoolingInfo,
                   vectors: Sequence[Any], prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """/v1/embeddings' response for the pooled `vectors` of `prompts`."""
    data = []
    for i, vec in enumerate(vectors):
        emb: Any = pooling.embedding(vec, req.dimensions, normalize=req.use_activation is True)
        if req.encoding_format == "base64":
            raw = np.asarray(emb, dtype=req.base64_dtype()).tobytes()
            emb = base64.b64encode(raw).decode()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "id": rid, "created": int(time.time()), "model": model,
            "data": data, "usage": usage(prompts)}


def score_body(rid: str, model: str, scores: Sequence[float],
               prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """/v1/score's response."""
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": usage(prompts)}


def rerank_body(rid: str, model: str, req: RerankRequest, scores: Sequence[float],
                prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """/v1/rerank's response: the `top_n` best documents (0 or None: all), best first."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
    return {"id": rid, "model": model,
            "results": [{"index": i, "document": req.document(i), "relevance_score": scores[i]}
                        for i in order],
            "usage": usage(prompts)}
