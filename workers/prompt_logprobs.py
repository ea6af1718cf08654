"""Prompt log-probabilities of a step's prefill chunks (SamplingParams.prompt_logprobs).

A sequence whose NewSeq carried its prompt (seq_table's `prompt_ids`) computes, in every
chunk, the log-probability of each prompt token the chunk predicts: position j's logits
predict token j + 1, so a chunk over positions [s, s + q) covers prompt tokens s + 1 ..
min(s + q, prompt_len - 1); the last prompt position predicts the first output token, which
the sampler handles. Targets come from the held prompt, since the last one may lie in the
next chunk.

Memory: the chunk's hidden rows are turned into logits `PROMPT_LOGPROB_ROWS` at a time, so a
step holds at most that many rows of vocabulary-sized logits (and their log-softmax), never
the chunk's whole prompt_len x vocab. Each slice runs `compute_logits` on every rank (on tp > 1
its gather is a collective); only rank 0 gets logits and computes the values
(`sampler.token_logprobs`: raw log-softmax, no temperature or penalties, as vLLM's
prompt logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from workers.qwen3 import Qwen3ForCausalLM
from workers.sampler import TokenLogprobs, token_logprobs
from workers.seq_table import SeqTable

# Hidden rows turned into logits at once: 256 rows of a 152k vocabulary are ~150 MiB of fp32
# logits plus as much again for their log-softmax.
PROMPT_LOGPROB_ROWS = 256


@dataclass(slots=True)
class PromptRows:
    """Which of a step's token rows compute prompt logprobs, and for whom."""

    request_ids: list[str]  # per sequence with prompt tokens in this step
    starts: np.ndarray  # int64 [R] prompt index of each one's first target
    counts: np.ndarray  # int64 [R] its targets in this step
    hidden_rows: np.ndarray  # int64 [M] token rows of the batch, entries back to back
    targets: np.ndarray  # int64 [M] the prompt token each row predicts
    k: int  # the largest prompt_logprobs of these sequences
    # their device copies (staged with the step's inputs)
    d_hidden_rows: Tensor | None = None
    d_targets: Tensor | None = None


def select_prompt_rows(table: SeqTable, seq_ids: np.ndarray, rows: np.ndarray,
                       start: np.ndarray, qlens: np.ndarray,
                       token_start: np.ndarray) -> PromptRows | None:
    """The step's PromptRows (None when no sequence of the batch predicts a prompt token).
    `token_start[i]`: the batch's first token row of sequence i."""
    k = table.num_prompt_logprobs[rows]
    last = table.prompt_len[rows] - 1  # positions < last predict a prompt token
    todo = np.flatnonzero((k >= 0) & (start < last))
    if not todo.size:
        return None
    ids, starts, counts, hidden, targets = [], [], [], [], []
    for i in todo.tolist():
        s = int(start[i])
        n = min(s + int(qlens[i]), int(last[i])) - s
        state = table.seqs[int(seq_ids[i])]
        assert state.prompt_ids is not None
        ids.append(state.request_id)
        starts.append(s + 1)
        counts.append(n)
        hidden.append(np.arange(n, dtype=np.int64) + int(token_start[i]))
        targets.append(state.prompt_ids[s + 1:s + 1 + n])
    return PromptRows(ids, np.array(starts, dtype=np.int64), np.array(counts, dtype=np.int64),
                      np.concatenate(hidden), np.concatenate(targets), int(k[todo].max()))


def compute_prompt_logprobs(model: Qwen3ForCausalLM, hidden: Tensor,
                            prompt: PromptRows) -> TokenLogprobs | None:
    """The step's prompt logprobs from its hidden states `[T, hidden]`, in slices of
    PROMPT_LOGPROB_ROWS rows (every rank calls it; None on ranks > 0)."""
    assert prompt.d_hidden_rows is not None and prompt.d_targets is not None
    parts = []
    for lo in range(0, prompt.hidden_rows.shape[0], PROMPT_LOGPROB_ROWS):
        hi = lo + PROMPT_LOGPROB_ROWS
        logits = model.compute_logits(hidden[prompt.d_hidden_rows[lo:hi]])
        if logits is not None:
            parts.append(token_logprobs(logits, prompt.d_targets[lo:hi], prompt.k))
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    return TokenLogprobs(*(torch.cat(columns) for columns in zip(*(
        (p.logprobs, p.ranks, p.top_token_ids, p.top_logprobs) for p in parts))))
