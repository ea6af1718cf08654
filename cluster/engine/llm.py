"""The offline API, shaped like vLLM's so code can switch: `LLM(model).generate(prompts, params)`,
with LoRA adapters as vLLM takes them: `LLM(model, enable_lora=True, max_loras=N,
max_lora_rank=R, max_cpu_loras=M)` and `generate(..., lora_request=LoRARequest(name, id, path))`
(one for every prompt, or a list with one per prompt, None for the base model).

A pooling model (`LLM(model, runner="pooling")`, or "auto" for a sentence-transformers or
reranker checkpoint: cluster/engine/pooling.py) answers `embed(prompts)` (`.outputs.embedding`)
and `score(query, documents)` (`.outputs.score`) instead of `generate`."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.pooling import (
    EmbeddingOutput,
    PoolingInfo,
    PoolingRequestOutput,
    ScoringOutput,
    check_pooling_input,
    pooling_params,
    rerank_prompt_ids,
    score_pairs,
)
from scheduler import RequestOutput as OutputDelta
from scheduler import SamplingParams
from scheduler.lora import LoRARequest
from scheduler.outputs import PromptLogprobList


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n samples, complete."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A finished request, as vLLM's `LLM.generate` returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: None first, then {token id: Logprob} per prompt token
    prompt_logprobs: PromptLogprobList | None = None
    pooled: np.ndarray | None = None  # a pooling runner's vector

    def merge(self, delta: OutputDelta) -> None:
        """Fold one step's delta in (the engine streams deltas; this keeps the totals)."""
        for d in delta.outputs:
            out = self.outputs[d.index]
            out.token_ids.extend(d.token_ids)
            out.text += d.text
            if d.logprobs is not None:
                out.logprobs = (out.logprobs or []) + list(d.logprobs)
            if d.finish_reason is not None:
                out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.pooled is not None:
            self.pooled = delta.pooled
        self.finished = delta.finished
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)


PromptType = str | dict[str, Any]


class LLM:
    """An engine for batch generation in this process (tp > 1 starts Ray worker actors)."""

    def __init__(self, model: str = "qwen3-tiny", tensor_parallel_size: int = 1,
                 dtype: str = "auto", device: str = "auto", block_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, gpu_memory_utilization: float = 0.9,
                 num_gpu_blocks_override: int | None = None, swap_space: float = 4,
                 enable_prefix_caching: bool = True, preemption_mode: str | None = None,
                 seed: int = 0, enforce_eager: bool = False, **kwargs: Any) -> None:
        self.config = EngineConfig.from_dict(dict(
            model=model, tensor_parallel_size=tensor_parallel_size, dtype=dtype, device=device,
            block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
            num_gpu_blocks_override=num_gpu_blocks_override, swap_space=swap_space,
            enable_prefix_caching=enable_prefix_caching, preemption_mode=preemption_mode,
            seed=seed, enforce_eager=enforce_eager,
            **{"cpu_exclusive": True, **kwargs}))  # nothing else runs in its step loop
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters `generate` uses when given none: the model's recommended
        ones from its generation_config.json (EngineConfig.generation_config "auto"), else
        SamplingParams()."""
        return self.engine.default_sampling_params()

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order.

        A prompt is a string or {"prompt_token_ids": [...]} (optionally with "prompt").
        All prompts, and the adapters they name, are validated before any is queued, so one
        bad prompt or adapter fails the call without leaving the others running.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if self.engine.pooling is not None:
            raise ValueError(f"{self.config.model!r} runs the pooling runner; call embed() or "
                             "score(), or start it with runner='generate'")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts; "
                             "pass one, or one per prompt")
        loras = (lora_request if isinstance(lora_request, list)
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts; pass "
                             "one, or one per prompt (None: the base model)")
        requests = [self._tokenize(p) for p in prompts]
        for (_, ids), sp in zip(requests, params):
            self.engine.validate(ids, sp)
        for lora in dict.fromkeys(r for r in loras if r is not None):
            self.engine.add_lora(lora)
        results: dict[str, RequestOutput] = {}
        order = []
        for (text, ids), sp, lora in zip(requests, params, loras):
            rid = str(next(self._ids))
            self.engine.add_request(rid, ids, sp, lora_request=lora)
            results[rid] = RequestOutput(rid, text, ids,
                                         [CompletionOutput(i) for i in range(sp.n)])
            order.append(rid)
        self._run(results, use_tqdm)
        return [results[rid] for rid in order]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.engine.tokenizer
        prompts: list[PromptType] = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           **(chat_template_kwargs or {}))
            prompts.append({"prompt": text,
                            "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def embed(self, prompts: PromptType | list[PromptType], use_tqdm: bool = True,
              dimensions: int | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (`.outputs.embedding`), in input order; `dimensions`
        truncates a Matryoshka model's vectors (re-normalized)."""
        info = self._pooling("embed")
        info.check_dimensions(dimensions)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        ids = [self._tokenize(p, add_special_tokens=True)[1] for p in prompts]
        return [PoolingRequestOutput(r.request_id, r.prompt_token_ids,
                                     EmbeddingOutput(info.embedding(r.pooled, dimensions)),
                                     num_cached_tokens=r.num_cached_tokens)
                for r in self._run_pooling(ids, use_tqdm)]

    def score(self, query: str | list[str], documents: str | list[str],
              instruction: str | None = None, use_tqdm: bool = True
              ) -> list[PoolingRequestOutput]:
        """A reranker's relevance of each document to the query (`.outputs.score`, P(yes)),
        with Qwen3-Reranker's prompt template applied here; `instruction` replaces its
        default task line."""
        self._pooling("score")
        tok = self.engine.tokenizer
        ids = [rerank_prompt_ids(tok, q, d, instruction) for q, d in score_pairs(query, documents)]
        return [PoolingRequestOutput(r.request_id, r.prompt_token_ids,
                                     ScoringOutput(float(r.pooled[0])),
                                     num_cached_tokens=r.num_cached_tokens)
                for r in self._run_pooling(ids, use_tqdm)]

    def _pooling(self, task: str) -> PoolingInfo:
        info = self.engine.pooling
        if info is None or info.task != task:
            raise ValueError(f"{task}() needs a pooling model whose task is {task!r}; "
                             f"{self.config.model!r} "
                             f"{'generates' if info is None else 'serves ' + info.task}")
        return info

    def _run_pooling(self, prompts: list[list[int]], use_tqdm: bool) -> list[RequestOutput]:
        for ids in prompts:
            check_pooling_input(ids, self.engine.max_model_len, "prompts")
        results: dict[str, RequestOutput] = {}
        for ids in prompts:
            rid = str(next(self._ids))
            self.engine.add_request(rid, ids, pooling_params())
            results[rid] = RequestOutput(rid, None, ids, [CompletionOutput(0)])
        self._run(results, use_tqdm)
        return list(results.values())

    def _tokenize(self, prompt: PromptType, add_special_tokens: bool = False
                  ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt,
                                                        add_special_tokens=add_special_tokens)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"], add_special_tokens)
        raise ValueError("a prompt must be a string or a dict with 'prompt_token_ids' "
                         f"(or 'prompt'); got {type(prompt).__name__}")

    def _run(self, results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(results), desc="Processed prompts", dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        try:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    res = results.get(delta.request_id)
                    if res is None:
                        continue
                    res.merge(delta)
                    generated += sum(len(c.token_ids) for c in delta.outputs)
                    if delta.finished and bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(
                            f"output {generated / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            for rid, res in results.items():
                if not res.finished:
                    self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
            self.engine.park()  # until the next call: the workers wait without burning CPU

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
