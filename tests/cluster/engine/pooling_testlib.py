"""What the pooling runner's engine tests share: the texts embedded (one long enough for
several prefill chunks at SMALL's step size), the reranker's vLLM overrides, and the cosine
check against an oracle's vector."""

from __future__ import annotations

import torch

COS = 0.9999
TEXTS = ["hello world", "x",
         "The quick brown fox jumps over the lazy dog while the sleepy cat watches. " * 6,
         "Paged attention stores the KV cache in fixed-size blocks."]
RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
                      "classifier_from_token": ["no", "yes"],
                      "is_original_qwen3_reranker": True}
# small steps, so the long text (~110 tokens) is prefilled in several chunks
SMALL = {"max_num_batched_tokens": 32, "max_num_seqs": 4, "max_model_len": 512}


def cos(a: list[float], b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), b.float(), dim=0))
