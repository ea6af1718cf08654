"""The pooling runner's engine side (vLLM's `runner: pooling`): which runner a checkpoint
gets, how it pools, what a pooling request is, and the outputs `LLM.embed` / `LLM.score`
return.

- Runner: `auto` is vLLM's rule: "pooling" for a checkpoint with sentence-transformers pooling
  files (workers/pooling_checkpoints.py) or a `*ForSequenceClassification` architecture (a
  reranker's `hf_overrides`), else "generate".
- Pooler (`PoolingInfo.pooler`): a reranker configured as vLLM's Qwen3-Reranker override
  (`architectures: [Qwen3ForSequenceClassification]`, `classifier_from_token: [no, yes]`,
  `is_original_qwen3_reranker: true`) scores P(yes) against "no" at the last token; otherwise
  the checkpoint's sentence-transformers pooling, else vLLM's default for a decoder turned
  embedding model (last token, normalized).
- A pooling request is a prefill that finishes with its last chunk: SamplingParams with
  max_tokens 1 (the scheduler needs no other mode); the workers' pooler replaces sampling, and
  the request's vector arrives on its last output (`RequestOutput.pooled`). Its input may hold
  up to max_model_len tokens, as vLLM allows: its SamplingParams are PoolingSamplingParams,
  whose placeholder output takes no position (scheduler/request.py `check_prompt_fits`).
- Prefix caching stays on for last-token pooling (the last position is always computed); for
  mean and CLS pooling, which need every position, the engine turns it off.
- Matryoshka `dimensions`: allowed where the config declares `is_matryoshka` (any size up to
  the width) or `matryoshka_dimensions` (those sizes); the vector is truncated, then
  re-normalized when the pooler normalizes.
- Qwen3-Reranker's prompt (its model card's): the system judgement line, `<Instruct>`,
  `<Query>`, `<Document>`, an empty think block; prefix, pair and suffix are tokenized apart
  and joined, exactly as the card's reference code does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cluster.engine.config import EngineConfig
from scheduler.sampling_params import PoolingSamplingParams
from workers.config import PoolerConfig
from workers.hf_config import read_hf_config
from workers.pooling_checkpoints import read_pooling_files

RUNNERS = ("auto", "generate", "pooling")
_CLASSIFIER_SUFFIX = "ForSequenceClassification"

RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based "
                 "on the Query and the Instruct provided. Note that the answer can only be "
                 "\"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = ("Given a web search query, retrieve relevant passages that answer the "
                      "query")


@dataclass(slots=True, frozen=True)
class PoolingInfo:
    """What a pooling engine serves: its pooler, its task ("embed" or "score"), its width and
    the Matryoshka sizes it accepts (None: none; () : any size up to `hidden_size`)."""

    pooler: PoolerConfig
    hidden_size: int
    matryoshka: tuple[int, ...] | None = None

    @property
    def task(self) -> str:
        return "score" if self.pooler.classify_token_ids is not None else "embed"

    def check_dimensions(self, dimensions: int | None) -> None:
        """ValueError unless `dimensions` (None: the full width) is a size this model allows."""
        if dimensions is None:
            return
        if self.matryoshka is None:
            raise ValueError(f"dimensions={dimensions}: this model does not declare Matryoshka "
                             "embeddings (is_matryoshka / matryoshka_dimensions in its "
                             "config.json or hf_overrides); leave dimensions out")
        allowed = self.matryoshka or None
        if (allowed is not None and dimensions not in allowed) or not (
                1 <= dimensions <= self.hidden_size):
            raise ValueError(f"dimensions={dimensions} is not one this model allows: "
                             f"{list(allowed) if allowed else f'1 to {self.hidden_size}'}")

    def embedding(self, pooled: np.ndarray, dimensions: int | None = None,
                  normalize: bool = False) -> list[float]:
        """The pooled vector as a list, truncated to `dimensions` (and re-normalized);
        `normalize`: normalized even where the pooler does not (vLLM's use_activation)."""
        vec = np.asarray(pooled, dtype=np.float32)
        truncated = dimensions is not None and dimensions < vec.shape[0]
        if truncated:
            vec = vec[:dimensions]
        if normalize or (truncated and self.pooler.normalize):
            vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
        return vec.tolist()


# EngineConfig settings that only act on generation: refused with the pooling runner.
_GENERATION_ONLY = {"speculative_config": None, "enable_lora": False, "reasoning_parser": None,
                    "tool_call_parser": None}


def resolve_pooling(model_path: str, config: EngineConfig, tokenizer: Any
                    ) -> PoolingInfo | None:
    """The engine's PoolingInfo (None: the generate runner); ValueError for a runner the
    checkpoint cannot take, or a generation-only setting beside the pooling runner."""
    runner = config.runner
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {list(RUNNERS)}; got {runner!r}")
    path = Path(model_path)
    raw = read_hf_config(path, config.hf_overrides)
    files = read_pooling_files(path)
    classifier = any(a.endswith(_CLASSIFIER_SUFFIX) for a in raw.get("architectures") or [])
    if runner == "auto":
        runner = "pooling" if files is not None or classifier else "generate"
    if runner == "generate":
        if classifier:
            raise ValueError(f"architectures {raw['architectures']} is a classifier: it serves "
                             "with runner 'pooling' (or 'auto'), not 'generate'")
        return None
    for key, off in _GENERATION_ONLY.items():
        if getattr(config, key) != off:
            raise ValueError(f"{key} acts only on generation; the pooling runner (embeddings, "
                             f"scores) does not use it: leave it out (it is {off!r} by default)")
    if classifier:
        pooler = PoolerConfig("LAST", normalize=False,
                              classify_token_ids=_classifier_ids(raw, tokenizer))
    elif files is not None:
        pooler = PoolerConfig(files["pooling_type"], files["normalize"])
    else:
        pooler = PoolerConfig("LAST", normalize=True)
    return PoolingInfo(pooler, int(raw["hidden_size"]), _matryoshka(raw))


def _classifier_ids(raw: dict[str, Any], tokenizer: Any) -> tuple[int, int]:
    tokens = raw.get("classifier_from_token")
    if not (isinstance(tokens, list) and len(tokens) == 2
            and all(isinstance(t, str) for t in tokens)):
        raise ValueError("a *ForSequenceClassification model is served here as Qwen3-Reranker "
                         "is: set hf_overrides classifier_from_token to its two tokens "
                         f"([\"no\", \"yes\"]) and is_original_qwen3_reranker: true; got "
                         f"classifier_from_token={tokens!r}")
    if raw.get("is_original_qwen3_reranker") is not True:
        raise ValueError("classifier_from_token is read as Qwen3-Reranker's yes/no head only "
                         "with hf_overrides is_original_qwen3_reranker: true (vLLM's spelling); "
                         "set it")
    ids = []
    for token in tokens:
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ValueError(f"classifier_from_token {token!r} is not one token of this "
                             "model's vocabulary")
        ids.append(int(tid))
    return ids[0], ids[1]


def _matryoshka(raw: dict[str, Any]) -> tuple[int, ...] | None:
    dims = raw.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return () if raw.get("is_matryoshka") else None


def pooling_params() -> PoolingSamplingParams:
    """A pooling request's SamplingParams: finished by the step of its last prompt chunk."""
    return PoolingSamplingParams(max_tokens=1, temperature=0.0)


def check_pooling_input(prompt_token_ids: list[int], max_model_len: int, field: str) -> None:
    """ValueError (naming `field`) for an empty input or one longer than a pooling request
    may be: max_model_len tokens, since none is generated (vLLM's rule)."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError(f"{field}: an input is empty; send at least one token")
    limit = pooling_params().max_prompt_len(max_model_len)
    if n > limit:
        raise ValueError(f"{field}: an input has {n} tokens; this server's max_model_len is "
                         f"{max_model_len}, so a pooling input may hold {limit}")


def rerank_prompt_ids(tokenizer: Any, query: str, document: str,
                      instruction: str | None = None) -> list[int]:
    """Qwen3-Reranker's model-card prompt for one (query, document) pair, as token ids."""
    pair = (f"<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}")
    encode = tokenizer.encode
    return (encode(RERANK_PREFIX, add_special_tokens=False) + tokenizer(pair)["input_ids"]
            + encode(RERANK_SUFFIX, add_special_tokens=False))


def score_pairs(query: str | list[str], documents: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's `score` pairing: one query against each document, or two lists pairwise."""
    docs = [documents] if isinstance(documents, str) else list(documents)
    if isinstance(query, str):
        return [(query, d) for d in docs]
    if len(query) != len(docs):
        raise ValueError(f"score got {len(query)} queries and {len(docs)} documents; pass one "
                         "query, or as many queries as documents")
    return list(zip(query, docs))


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class PoolingRequestOutput:
    """vLLM's EmbeddingRequestOutput / ScoringRequestOutput: `.outputs.embedding` or
    `.outputs.score`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ScoringOutput
    finished: bool = True
    num_cached_tokens: int = 0
