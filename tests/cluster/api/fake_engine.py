"""A small deterministic fake of the engine's async API, and helpers to call the OpenAI app
over it (no Ray, no model), for the HTTP layer's tests (conftest.py makes the fixtures).

The fake implements AsyncLLMEngine's async API: sample i of a request emits, at step t,
token SCRIPT[(i + t) % len(SCRIPT)] with a fixed logprob table, so every test can state
the exact text, tokens and logprobs it expects. The real engine over real HTTP is tested
in test_serve_http.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from cluster.api.engine_client import LocalEngineClient
from cluster.api.openai_api import create_app
from cluster.engine.config import EngineConfig
from cluster.engine.errors import EngineDeadError, OverloadedError
from cluster.engine.metrics import Histogram
from scheduler import CompletionOutput, RequestOutput, SamplingParams

SCRIPT_TEXT = " one two three four five six seven eight nine ten"
MODEL = "fake-qwen3"


class FakeEngine:
    model_name = MODEL
    max_model_len = 64
    config = EngineConfig(max_num_seqs=8)
    default_sampling: dict = {}  # (a test may set the model's generation_config defaults)
    pooling = None  # a generate model (the pooling runner's routes answer 400)

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.script = tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
        self.calls: list[tuple[list[int], SamplingParams, str, str | None]] = []
        self.aborted: list[str] = []
        self.dead: str | None = None
        self.overloaded = False
        self.fail_at: int | None = None  # raise an internal error at this step

    def token(self, i: int, t: int) -> int:
        return self.script[(i + t) % len(self.script)]

    def logprobs(self, i: int, t: int, k: int) -> dict[int, float]:
        lps = {self.token(i, t + 1 + j): -0.5 * (j + 1) for j in range(k)}
        lps[self.token(i, t)] = -0.25
        return lps

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str, cache_salt: str | None = None,
                       lora_request: Any = None):
        sp = sampling_params
        if self.dead:
            raise EngineDeadError(self.dead)
        if self.overloaded:
            raise OverloadedError("3 requests are already waiting (max_waiting_requests=3)")
        if len(prompt_token_ids) + sp.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_token_ids)}) + max_tokens ({sp.max_tokens}) "
                             f"> max_model_len ({self.max_model_len})")
        self.calls.append((list(prompt_token_ids), sp, request_id, cache_salt))
        live = set(range(sp.n))
        finished = False
        try:
            for t in range(sp.max_tokens):
                await asyncio.sleep(0)
                if t == self.fail_at:
                    raise RuntimeError("step failed on node 10.0.0.7: Traceback (most recent "
                                       "call last): File /srv/worker.py")
                outs = []
                for i in sorted(live):
                    tok = self.token(i, t)
                    reason = ("stop" if tok in sp.stop_token_ids
                              else "length" if t == sp.max_tokens - 1 else None)
                    outs.append(CompletionOutput(
                        index=i, token_ids=[tok], text="" if reason == "stop" else self.text(tok),
                        finish_reason=reason, stop_reason=tok if reason == "stop" else None,
                        logprobs=None if sp.logprobs is None else [self.logprobs(i, t, sp.logprobs)]))
                    if reason:
                        live.discard(i)
                finished = not live
                yield RequestOutput(request_id, prompt_token_ids, outs, finished,
                                    num_cached_tokens=3)
                if finished:
                    return
        finally:
            if not finished:
                self.aborted.append(request_id)

    def text(self, tok: int) -> str:
        return self.tokenizer.decode([tok])

    def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)

    def check_ready(self) -> None:  # (AsyncLLMEngine's: also while it rebuilds its workers)
        self.check_health()

    def metrics(self) -> dict[str, Any]:
        ttft = Histogram((0.1, 1.0))
        for v in (0.05, 0.5, 3.0):
            ttft.observe(v)
        return {"num_requests_running": 2, "num_requests_waiting": 1, "num_requests_swapped": 0,
                "kv_cache_usage_perc": 0.25, "prefix_cache_queries": 40, "prefix_cache_hits": 16,
                "external_prefix_cache_queries": 24, "external_prefix_cache_hits": 8,
                "kv_offload_blocks_offloaded": 5, "kv_offload_blocks_loaded": 2,
                "kv_offload_usage_perc": 0.5,
                "prompt_tokens_total": 40, "generation_tokens_total": 7,
                "num_preemptions_swap": 1, "num_preemptions_recompute": 2,
                "num_worker_recoveries": 0,
                "kv_transfer_exports_total": 0, "kv_transfer_imports_total": 0,
                "kv_transfer_fallbacks_total": 0, "kv_transfer_bytes_out_total": 0,
                "kv_transfer_bytes_in_total": 0, "kv_transfer_seconds": Histogram((0.1, 1.0)),
                "spec_decode_num_drafts": 3, "spec_decode_num_draft_tokens": 9,
                "spec_decode_num_accepted_tokens": 5,
                "spec_decode_num_accepted_tokens_per_pos": [3, 2, 0],
                "request_success_total": {"stop": 1, "length": 2, "abort": 0},
                "time_to_first_token_seconds": ttft,
                "inter_token_latency_seconds": Histogram((0.01,)),
                "e2e_request_latency_seconds": Histogram((1.0,)),
                "request_queue_time_seconds": Histogram((0.3,), [1, 0], 0.2, 1),
                "request_prefill_time_seconds": Histogram((0.3,)),
                "request_decode_time_seconds": Histogram((0.3,)),
                "request_inference_time_seconds": Histogram((0.3,))}


def fetch(engine: FakeEngine, tokenizer: Any, method: str, path: str, body: Any = None,
          api_key: str | None = None, headers: dict[str, str] | None = None,
          max_body_bytes: int | None = None) -> httpx.Response:
    """One request to a fresh app; `body` is bytes, str, an async iterator of byte chunks (sent
    chunked, without Content-Length) or anything else (sent as JSON)."""
    app = create_app(LocalEngineClient(engine), tokenizer, api_key=api_key,
                     max_body_bytes=max_body_bytes)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            content = (body if isinstance(body, (bytes, str)) or body is None
                       or hasattr(body, "__aiter__") else json.dumps(body))
            return await client.request(method, path, content=content, headers=headers)

    return asyncio.run(go())


def sse_events(resp: httpx.Response) -> list[Any]:
    events = [line[len("data: "):] for line in resp.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]
