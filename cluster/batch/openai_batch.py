"""OpenAI's batch file format over the processor: one JSON request per input line
(`custom_id`, `method`, `url`, `body`), one JSON result per output line (`id`, `custom_id`,
`response: {status_code, request_id, body}`, `error`).

A body is read as the HTTP API reads it: the same request models (cluster/api/protocol.py:
strict types, unknown fields refused, constraints), chat template and length checks
(cluster/api/openai_prompts.py), and the model's generation_config defaults; a good request's
`body` is what the HTTP API returns for it without streaming. What a batch line cannot ask for
is refused by name (`stream`, `n` > 1, `logprobs`, `echo`, `tools`, several prompts in one
completion), never ignored. A pooling model's lines (/v1/embeddings, /v1/score, /v1/rerank)
are pooling_batch.py's.

Invariants: every input line gives exactly one output line. A request the HTTP API would
refuse gets `response.status_code` 400 (or the API's status) with its OpenAI error body and
`error` null; so does a line whose url the model does not serve (generation of a pooling
model, an embedding of a chat model: vLLM's run_batch answers such lines one by one too). A
line that is no request at all (not JSON, no `custom_id`, a method other than POST, a url
this format does not know) gets `response` null and `error: {code, message}`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import uuid
from typing import Any

from pydantic import ValidationError

from cluster.api.openai_prompts import PromptProcessor
from cluster.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    error_body,
    validation_error_message,
)
from cluster.batch.pooling_batch import POOLING_URLS, pooling_body, pooling_prompts
from cluster.batch.stages import engine_pooling, tokenizer_for
from cluster.engine.config import EngineConfig
from cluster.engine.pooling import PoolingInfo

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
_REQUESTS = {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest}


@dataclasses.dataclass(frozen=True, slots=True)
class ModelFacts:
    """What reading a request needs to know of the engine, found without starting one."""

    model: str
    max_model_len: int
    sampling_defaults: dict[str, Any]
    pooling: PoolingInfo | None = None  # the pooling runner's (None: a generation model)

    @classmethod
    def of(cls, config: EngineConfig) -> ModelFacts:
        from cluster.engine.engine_setup import default_sampling
        from workers.model_config import load_model_config
        from workers.tiny_model import resolve_model

        path = resolve_model(config.model)
        limit = load_model_config(path, config.tensor_parallel_size).max_position_embeddings
        return cls(config.model, config.max_model_len or limit,
                   default_sampling(path, config.generation_config), engine_pooling(config))


@functools.lru_cache(maxsize=4)
def _prompts(model: str) -> PromptProcessor:
    return PromptProcessor(tokenizer_for(model))


def read_request(line: dict[str, Any], facts: ModelFacts) -> dict[str, Any]:
    """One input line (Ray Data's `text` column) -> a processor row: `prompt_token_ids` and
    `sampling_params` (JSON text), or a pooling line's `pooling_inputs` and `body`, or
    `error` with its OpenAI `error_body`."""
    row: dict[str, Any] = {"custom_id": None, "url": None, "request_error": None,
                           "error_body": None, "status_code": None, "error": None}
    try:
        request = json.loads(line["text"])
        if not isinstance(request, dict):
            raise ValueError(f"a line is a JSON object; got {type(request).__name__}")
    except ValueError as e:
        row["request_error"] = row["error"] = f"the line is not a JSON request object: {e}"
        return row
    row["custom_id"], row["url"] = request.get("custom_id"), request.get("url")
    if not isinstance(row["custom_id"], str):
        row["request_error"] = "custom_id is missing (a string naming the request)"
    elif request.get("method") != "POST":
        row["request_error"] = f"method must be POST; got {request.get('method')!r}"
    elif row["url"] not in _REQUESTS and row["url"] not in POOLING_URLS:
        row["request_error"] = (f"url must be one of {[*_REQUESTS, *POOLING_URLS]}; got "
                                f"{row['url']!r}")
    elif not isinstance(request.get("body"), dict):
        row["request_error"] = "body is missing (the request's JSON object)"
    if row["request_error"]:
        row["error"] = row["request_error"]
        return row
    try:
        if row["url"] in POOLING_URLS:
            req = _validate(POOLING_URLS[row["url"]][0], request["body"])
            row["pooling_inputs"] = pooling_prompts(req, row["url"], facts.pooling, facts.model,
                                                    _prompts(facts.model), facts.max_model_len)
            row["body"] = json.dumps(request["body"])
            return row
        ids, params = _prepare(_REQUESTS[row["url"]], request["body"], facts)
    except RequestError as e:
        row.update(error=e.message, error_body=json.dumps(e.body()), status_code=e.status)
        return row
    row["prompt_token_ids"] = ids
    row["sampling_params"] = json.dumps(dataclasses.asdict(params))
    return row


def _validate(model: type, body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        message, param = validation_error_message(e.errors())
        raise RequestError(message, param=param) from None


def _prepare(model: type, body: dict[str, Any], facts: ModelFacts) -> tuple[list[int], Any]:
    """The HTTP route's steps: validate, refuse what a batch line cannot do, prompt ids,
    max_tokens, sampling parameters."""
    req = _validate(model, body)
    if facts.pooling is not None:  # the HTTP API's answer (cluster/api/openai_api.py _start)
        raise RequestError(f"`{facts.model}` is a pooling model (runner: pooling); it answers "
                           f"{', '.join(POOLING_URLS)}, not generation", param="model")
    refused = [name for name, on in (("stream", req.stream), ("n", req.n != 1),
                                     ("logprobs", req.logprobs is not None and req.logprobs is not False),
                                     ("echo", getattr(req, "echo", False)),
                                     ("tools", bool(getattr(req, "tools", None))))
               if on]
    if refused:
        raise RequestError(f"{refused[0]} is not supported in a batch request (one whole "
                           "completion per line); remove it", param=refused[0])
    prompts = _prompts(facts.model)
    if isinstance(req, ChatCompletionRequest):
        ids = prompts.render_chat(req, facts.max_model_len)
        requested = req.requested_max_tokens
    else:
        batch = prompts.completion_prompts(req.prompt, facts.max_model_len)
        if len(batch) != 1:
            raise RequestError(f"prompt holds {len(batch)} prompts; a batch line sends one "
                               "(one line per prompt)", param="prompt")
        ids, requested = batch[0], req.max_tokens
    max_tokens = prompts.max_tokens(requested, len(ids), facts.max_model_len)
    return ids, req.to_sampling_params(max_tokens, facts.sampling_defaults)


def write_result(row: dict[str, Any], model: str,
                 pooling: PoolingInfo | None = None) -> dict[str, Any]:
    """A processor output row -> {"line": the output line's JSON, "failed", "tokens"}
    (`pooling`: the engine's, which formats a pooling line's vectors)."""
    out: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": row["custom_id"],
                           "response": None, "error": None}
    if row.get("request_error"):
        out["error"] = {"code": "invalid_request", "message": row["request_error"]}
    elif row.get("error"):  # refused by the HTTP API's checks, or by the engine's
        body = (json.loads(row["error_body"]) if row.get("error_body")
                else error_body(row["error"], "invalid_request_error"))
        out["response"] = {"status_code": row.get("status_code") or 400,
                           "request_id": f"batch-{uuid.uuid4().hex}", "body": body}
    else:
        body = (pooling_body(row, model, pooling) if pooling is not None
                else response_body(row, model))
        out["response"] = {"status_code": 200, "request_id": body["id"], "body": body}
    return {"line": json.dumps(out, ensure_ascii=False), "failed": out["response"] is None
            or out["response"]["status_code"] != 200,
            "tokens": row.get("num_generated_tokens") or 0}


def response_body(row: dict[str, Any], model: str) -> dict[str, Any]:
    """The body the HTTP API returns for this request when not streaming
    (cluster/api/openai_responses.py's `final`, for one choice without logprobs)."""
    chat = row["url"] == CHAT
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": row["generated_text"]}
    else:
        choice["text"] = row["generated_text"]
    choice.update(logprobs=None, finish_reason=row["finish_reason"],
                  stop_reason=row["stop_reason"])
    prompt, completion = row["num_input_tokens"], row["num_generated_tokens"]
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{row['request_id']}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": row["num_cached_tokens"] or 0}}}
