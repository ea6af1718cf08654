"""One step's batch on the device (`StepBatch`) and the host-side array helpers that build it.

`workers/model_runner.py` fills a `StepBatch` per step from the plan and the persistent batch
(`workers/seq_table.py`); the functions here are pure numpy over that table's arrays (speculative
verify rows, penalty rows, each token's LoRA slot, padding to a graph's size): nothing reads a
device value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

from workers.cuda_graph import CUDAGraphRunner
from workers.draft_runner import DraftBatch, draft_entries
from workers.layers.attention import AttentionMetadata, OutputRows
from workers.prompt_logprobs import PromptRows
from workers.sampler import SamplingMetadata, TokenLogprobs
from workers.seq_table import SeqTable

NO_PENALTIES = (None,) * 8


@dataclass(slots=True)
class StepBatch:
    """One step's inputs on the device, and the host facts the worker needs around them."""

    step_id: int
    input_ids: Tensor  # int64 [T] (padded to the graph's size on graph steps)
    positions: Tensor
    attn_metadata: AttentionMetadata
    logits_indices: Tensor | None  # [S] hidden rows to sample; None: every row, in order
    sampling: SamplingMetadata | None  # None: nothing samples this step
    simple: bool  # greedy/temperature-only: a graph step samples inside the graph
    graphs: CUDAGraphRunner | None  # whose graph this step replays (decode or verify); None: eager
    graph_size: int  # 0: eager; else the captured batch size this step replays
    graph_i64: Tensor | None  # the staged region the graph's int64 inputs come from
    graph_rows: Tensor | None  # int64 [graph_size] table rows (padding: row 0)
    graph_temperature: Tensor | None  # float32 [graph token rows] (padding: 0.0)
    # int64 [P] token rows whose id is the last step's sample; None: rows 0..P-1 (every one)
    pending_pos: Tensor | None
    pending_src: Tensor | None  # int64 [P] index of that sample in the last step's output
    penalty_tokens: tuple[Tensor, Tensor, Tensor] | None  # (token rows, slots, is_prompt)
    # (batch rows, slots, repetition, frequency, presence) of the penalized sampled rows
    penalty_rows: tuple[Tensor, ...] | None
    sample_rows: np.ndarray  # table rows of the sampled sequences, batch order
    sampled_seq_ids: np.ndarray  # int64 [S]
    rows: np.ndarray  # table rows of the batch
    constrained_rows: np.ndarray  # the plan's (sampled rows waiting for a grammar bitmask)
    # verify rows (speculative decoding): rejection_sampler.num_accepted's (gather, drafts)
    verify: tuple[Tensor, Tensor] | None = None
    # verify rows whose proposals the draft model makes this step (workers/draft_runner.py)
    draft: DraftBatch | None = None
    # a verify graph step whose every row's proposals are the draft's: the graph's captured
    # `propose` makes them (workers/cuda_graph.py), no host-made entries
    draft_in_graph: bool = False
    # sequences whose chunks predict prompt tokens (workers/prompt_logprobs.py), and what
    # forward() computed for them (rank 0)
    prompt: PromptRows | None = None
    prompt_out: TokenLogprobs | None = None
    # LoRA: int64 [T (+ graph padding)] each token's adapter slot (-1: base); None: LoRA off
    lora_slots: Tensor | None = None
    lora_active: bool = False  # some sequence of the step has an adapter
    pooled: Tensor | None = None  # the pooling runner's output (workers/pooler.py), rank 0
    # the sampled rows, when fewer than the step's tokens: the last layer computes only these
    # (workers/qwen3.py) and the final hidden states come back in sampling order
    out_rows: OutputRows | None = None

    @property
    def num_sampled(self) -> int:
        """Logit rows sampled: one per sampled sequence, d + 1 for a verify row."""
        return int(self.sample_rows.shape[0])


def draft_entries_for(drafts: np.ndarray, last_idx: np.ndarray, sample_rows: np.ndarray,
                      positions: np.ndarray, slots: np.ndarray, draft_at: np.ndarray):
    """The draft model's entries for the verify rows whose proposals are all DRAFT_TOKEN
    (ValueError for a DRAFT_TOKEN anywhere else)."""
    first = last_idx - drafts
    on = np.where(draft_at[np.minimum(first + 1, draft_at.shape[0] - 1)], drafts, 0)
    entries = draft_entries(on, first, sample_rows, positions, slots, int(drafts.max()) + 1)
    if int(on.sum()) != int(draft_at.sum()) or not draft_at[entries.i64[4]].all():
        raise ValueError("DRAFT_TOKEN may only stand for all of a verify row's proposals")
    return entries


def penalty_arrays(table: SeqTable, sample_rows: np.ndarray, token_rows: np.ndarray,
                   positions: np.ndarray) -> tuple[np.ndarray | None, ...]:
    """The staged arrays of penalized sequences: int64 (sampled rows with penalties, their
    slots, token rows of their inputs, those tokens' slots), float32 (is-prompt per such
    token, then the three penalties per sampled row); None where there are none."""
    pen_rows = np.flatnonzero(table.penalty_slot[sample_rows] >= 0)
    tok_slot = table.penalty_slot[token_rows]
    pen_tokens = np.flatnonzero(tok_slot >= 0)
    rows = sample_rows[pen_rows]
    is_prompt = (positions[pen_tokens] < table.prompt_len[token_rows[pen_tokens]]
                 ).astype(np.float32)
    have_rows, have_tokens = bool(pen_rows.size), bool(pen_tokens.size)
    return (pen_rows if have_rows else None,
            table.penalty_slot[rows] if have_rows else None,
            pen_tokens if have_tokens else None,
            tok_slot[pen_tokens] if have_tokens else None,
            is_prompt if have_tokens else None,
            table.repetition_penalty[rows] if have_rows else None,
            table.frequency_penalty[rows] if have_rows else None,
            table.presence_penalty[rows] if have_rows else None)


def verify_rows(drafts: np.ndarray, sample_rows: np.ndarray, logits_idx: np.ndarray,
                 s_counter: np.ndarray, constrained: np.ndarray, input_ids: np.ndarray
                 ) -> tuple[np.ndarray, ...]:
    """Expand the sampled rows for verify rows: a row with d proposals samples at its last
    d + 1 positions, each with the random stream of its own output index. Returns the
    expanded (table rows, logits indices, rng counters), the constrained rows' new indices,
    and rejection_sampler.num_accepted's (gather, drafts) arrays."""
    reps = drafts + 1
    starts = np.zeros(reps.shape[0] + 1, dtype=np.int64)
    np.cumsum(reps, out=starts[1:])
    total = int(starts[-1])
    row_of = np.repeat(np.arange(reps.shape[0]), reps)
    j = np.arange(total, dtype=np.int64) - starts[row_of]  # position within the row
    idx = np.repeat(logits_idx - drafts, reps) + j
    width = int(reps.max())
    gather = np.minimum(starts[:-1, None] + np.arange(width), starts[1:, None] - 1)
    proposal = np.full((reps.shape[0], width), -1, dtype=np.int64)
    is_draft = j < drafts[row_of]
    # position idx predicts the token at idx + 1: the proposal there
    proposal[row_of[is_draft], j[is_draft]] = input_ids[idx[is_draft] + 1]
    return (np.repeat(sample_rows, reps), idx, np.repeat(s_counter - drafts, reps) + j,
            starts[constrained], (gather, proposal))


def output_row_arrays(logits_idx: np.ndarray, cu: np.ndarray | None, positions: np.ndarray,
                      rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(table rows, seq lens) of the token rows `logits_idx` as one-token queries at their own
    positions (`OutputRows`' metadata): a row of sequence b (rows cu[b]:cu[b+1]; cu None: one
    row each) at position p attends to b's first p + 1 tokens."""
    seq_of = logits_idx if cu is None else np.searchsorted(cu, logits_idx, side="right") - 1
    return rows[seq_of], positions[logits_idx] + 1


def lora_slots(table: SeqTable, token_rows: np.ndarray, pad: int, max_tokens: int) -> np.ndarray:
    """Each token's adapter slot, padded with -1 (base) to the graph's token rows."""
    slots = padded(table.lora_slot[token_rows], pad, -1)
    if slots.shape[0] > max_tokens:
        raise ValueError(f"a step of {slots.shape[0]} tokens exceeds the {max_tokens} the LoRA "
                         "slot buffer holds (max_num_batched_tokens)")
    return slots


def padded(a: np.ndarray, pad: int, value: float) -> np.ndarray:
    if not pad:
        return a
    return np.concatenate([a, np.full(pad, value, dtype=a.dtype)])


def max_top_k(table: SeqTable, sample_rows: np.ndarray) -> int | None:
    """SamplingMetadata.max_top_k of these rows: the largest top_k of those that sample at
    random, or None when one of them has none (its masks then need every value ordered)."""
    random = table.temperature[sample_rows] > 0
    top_k = table.top_k[sample_rows][random]
    return int(top_k.max()) if top_k.size and top_k.min() > 0 else None
