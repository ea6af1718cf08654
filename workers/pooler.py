"""The pooling runner's pooler: a mode of the model runner that turns a step's last hidden
states into one vector per finishing sequence instead of sampling (vLLM's `runner: pooling`).

A pooling request is a prefill that finishes with its last chunk (max_tokens 1): its final
chunk's row is the step's "sampled" row, and the pooler's output for it goes back in the
StepResult (`pooled`, rank 0) with a placeholder token id 0 that nothing reads. At
pipeline_parallel_size > 1 only the last stage has a pooler (workers/worker.py): it holds the
final hidden states, the final norm and the LM head, and its first rank is the output rank.

- LAST: the hidden state of the sequence's last token (Qwen3-Embedding, the reranker).
- MEAN / CLS: chunked prefill splits a prompt over steps, so each step adds its chunk's rows
  into a per-table-row sum and count (and keeps position 0's row); a chunk that starts at
  position 0 resets the row first, so a reused row or a recomputed sequence starts clean.
  Cached prefix positions are never computed, so the engine turns prefix caching off for
  these two (cluster/engine/pooling.py).
- `classify_token_ids` (no, yes): the reranker's score, softmax over those two logits of the
  last token = sigmoid(yes - no), from `compute_logits` (a collective on tp > 1, called on
  every rank).
- `normalize`: L2-normalised output (sentence-transformers' Normalize module).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from workers.config import PoolerConfig
from workers.layers.attention import AttentionMetadata
from workers.qwen3 import Qwen3ForCausalLM


class Pooler:
    """Per-table-row running sums for MEAN / CLS, and the pooling of a step's finishing rows."""

    def __init__(self, config: PoolerConfig, max_num_seqs: int, hidden_size: int,
                 device: torch.device, is_first_rank: bool) -> None:
        self.config = config
        self.is_first_rank = is_first_rank
        self.sums = self.counts = self.cls = None
        if config.accumulates:
            self.sums = torch.zeros(max_num_seqs, hidden_size, dtype=torch.float32, device=device)
            self.counts = torch.zeros(max_num_seqs, dtype=torch.float32, device=device)
            self.cls = torch.zeros(max_num_seqs, hidden_size, dtype=torch.float32, device=device)

    def pool(self, model: Qwen3ForCausalLM, hidden: Tensor, md: AttentionMetadata,
             positions: Tensor, rows: np.ndarray, logits_indices: Tensor | None,
             sample_rows: np.ndarray) -> Tensor | None:
        """float32 [S, D] for the step's S finishing sequences (rank 0; None elsewhere, and
        when none finishes). `rows`: the batch's table rows; `logits_indices`: the hidden
        rows of the finishing sequences' last tokens (None: every row, in order)."""
        if self.config.accumulates:
            self._accumulate(hidden, md, positions, rows)
        if not sample_rows.shape[0]:
            return None
        if self.config.pooling_type == "LAST":
            last = hidden if logits_indices is None else hidden[logits_indices]
            if self.config.classify_token_ids is not None:
                logits = model.compute_logits(last)  # (every rank: a collective on tp > 1)
                if logits is None:
                    return None
                no, yes = self.config.classify_token_ids
                pair = logits[:, [no, yes]].float()
                return torch.softmax(pair, dim=-1)[:, 1:]
            out = last.float()
        else:
            at = torch.as_tensor(sample_rows, device=hidden.device)
            out = (self.cls[at] if self.config.pooling_type == "CLS"
                   else self.sums[at] / self.counts[at, None])
        if not self.is_first_rank:
            return None
        return F.normalize(out, dim=-1) if self.config.normalize else out

    def _accumulate(self, hidden: Tensor, md: AttentionMetadata, positions: Tensor,
                    rows: np.ndarray) -> None:
        n = rows.shape[0]
        starts = md.query_start_loc[:n + 1].long()
        lens = starts[1:] - starts[:-1]
        at = torch.as_tensor(rows, device=hidden.device)
        fresh = positions[starts[:-1]] == 0  # a chunk from position 0: a new sequence here
        keep = (~fresh).float()
        self.sums[at] *= keep[:, None]
        self.counts[at] *= keep
        seg = torch.repeat_interleave(at, lens, output_size=int(hidden.shape[0]))
        self.sums.index_add_(0, seg, hidden.float())
        self.counts.index_add_(0, at, lens.float())
        self.cls[at[fresh]] = hidden[starts[:-1][fresh]].float()
