"""The worker's persistent batch: one row per sequence it holds, from its NewSeq to its drop.

A row keeps the sequence's block table (a host mirror and a device copy, both changed only by
the plan's diffs), its prompt length, how many tokens it has computed, and its sampling
settings, all as column arrays: a step's inputs are numpy gathers by row, never a Python loop
over the batch. A sequence with penalties or a logit bias also holds a penalty slot: device
tensors of its output-token counts and prompt-token mask, updated on the device from each
step's input tokens (which may be pending tokens the host never sees), and of its logit bias.
A sequence computing prompt logprobs holds its prompt on the host (`SeqState.prompt_ids`;
workers/prompt_logprobs.py reads each chunk's targets from it).

Invariants:
- `rows_of(seq_ids)` gives a row for exactly the sequences with state; a row is in use by one
  sequence at a time, and a free row's `num_blocks` is 0;
- `block_table[row, :num_blocks[row]]` is the sequence's table; the device table equals it
  once the diffs taken by `take_block_diff()` have been scattered on the device (the model
  runner does that in the same step, before the forward pass reads the table; on CPU the
  device table is the host table, `device_is_host`, and there is nothing to scatter: the
  model runner's table there keeps no diff, `keep_diffs=False`). The diff is each changed
  row's entries from `dirty_from[row]` (the first column written since the last take; -1:
  none) to its end, read from the host table when taken: one write per entry;
- a plan's block writes (new tables, appended blocks, replaced tables) are numpy over all the
  plan's sequences at once, checked before anything is written;
- `num_tokens[row]` counts every token the worker was given for the sequence (its computed
  tokens when it arrived, plus each step's inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from scheduler.plan import NewSeq, StepPlan
from workers.sampler import stream_key

# Sampling features of a row (SeqTable.features): a step ORs its sampled rows' bits to know
# which parts of the sampler it needs.
RANDOM, TOP_K, TOP_P, MIN_P, LOGPROBS, PENALTIES = 1, 2, 4, 8, 16, 32

# Unseeded samples draw from the stream of (engine seed, this offset + seq id): apart from
# every seeded stream, which a request's own (seed, seq_index) keys.
_UNSEEDED_STREAM = 1 << 40


@dataclass(slots=True)
class SeqState:
    """Host facts about one sequence that no step reads in bulk."""

    row: int
    request_id: str
    penalty_slot: int  # -1: no penalties
    # the prompt, for a sequence computing prompt logprobs (NewSeq.prompt_token_ids)
    prompt_ids: np.ndarray | None = None


class SeqRows:
    """seq_id -> row, as a numpy array over the window of ids between the oldest and the newest
    sequence held (the scheduler's ids only grow, so the window slides; any id works).

    The window's first and last entries are never set (-1): a lookup clips an id outside the
    window to one of them, so one gather and no range check find every row or its absence."""

    def __init__(self) -> None:
        self.base = -1  # the id of rows[0], a sentinel
        self.rows = np.full(1024, -1, dtype=np.int64)

    def lookup(self, seq_ids: np.ndarray) -> np.ndarray:
        """Rows of `seq_ids` (-1 for an id without state)."""
        return self.rows.take(seq_ids - self.base, mode="clip")

    def set(self, seq_id: int, row: int) -> None:
        if not 0 < seq_id - self.base < self.rows.shape[0] - 1:
            if row < 0:
                return  # outside the window: it has no row already
            self._make_room(seq_id)
        self.rows[seq_id - self.base] = row

    def _make_room(self, seq_id: int) -> None:
        """Re-window over the live ids and `seq_id`, with room to grow into and a sentinel at
        each end."""
        live = np.flatnonzero(self.rows >= 0)
        lo, hi = seq_id, seq_id
        if live.size:
            lo, hi = min(lo, self.base + int(live[0])), max(hi, self.base + int(live[-1]))
        size = self.rows.shape[0]
        while size < 2 * (hi - lo + 1) + 2:
            size *= 2
        rows = np.full(size, -1, dtype=np.int64)
        if live.size:
            first = self.base + int(live[0]) - lo + 1
            rows[first:first + int(live[-1] - live[0]) + 1] = self.rows[live[0]:live[-1] + 1]
        self.base, self.rows = lo - 1, rows


class PenaltyState:
    """Per penalized sequence, device counts of its output tokens and of its prompt tokens, and
    its logit bias (zeros without one)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.prompt_counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.logit_bias = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.free: list[int] = []
        self.num_used = 0  # slots held (a plain int: every step reads it)

    def acquire(self, prompt: list[int], outputs: list[int],
                logit_bias: dict[int, float] | None = None) -> int:
        """A slot holding these prompt and output tokens and this bias (a sequence's arrival,
        not a decode)."""
        if not self.free:
            old = self.output_counts.shape[0]
            grow = max(4, old)
            zeros = torch.zeros(grow, self.vocab_size, dtype=torch.float32, device=self.device)
            self.output_counts = torch.cat([self.output_counts, zeros])
            self.prompt_counts = torch.cat([self.prompt_counts, zeros])
            self.logit_bias = torch.cat([self.logit_bias, zeros])
            self.free.extend(range(old + grow - 1, old - 1, -1))
        slot = self.free.pop()
        self.num_used += 1
        for counts, tokens in ((self.prompt_counts, prompt), (self.output_counts, outputs)):
            counts[slot].zero_()
            if tokens:
                ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
                counts[slot].index_add_(0, ids, torch.ones(len(tokens), device=self.device))
        self.logit_bias[slot].zero_()
        if logit_bias:
            ids = torch.tensor(list(logit_bias), dtype=torch.int64, device=self.device)
            values = torch.tensor(list(logit_bias.values()), dtype=torch.float32,
                                  device=self.device)
            self.logit_bias[slot].index_copy_(0, ids, values)
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)
        self.num_used -= 1

    def record(self, slots: Tensor, token_ids: Tensor, is_prompt: Tensor) -> None:
        """Count a step's input tokens of penalized sequences: `slots`, `token_ids` int64 [N],
        `is_prompt` float32 [N] (1.0 for a prompt token), all on the device."""
        self.prompt_counts.index_put_((slots, token_ids), is_prompt, accumulate=True)
        self.output_counts.index_put_((slots, token_ids), 1.0 - is_prompt, accumulate=True)


class SeqTable:
    """Rows of per-sequence state (see the module docstring)."""

    def __init__(self, max_num_seqs: int, block_size: int, max_model_len: int,
                 vocab_size: int, seed: int, device: torch.device,
                 keep_diffs: bool = True) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.vocab_size = vocab_size
        self.seed = seed
        self.device = device
        self.device_is_host = device.type == "cpu"
        self.seqs: dict[int, SeqState] = {}
        self.seq_rows = SeqRows()
        self.num_gpu_blocks = 0  # set once the cache exists
        self.penalties = PenaltyState(vocab_size, device)
        self.num_prompt_logprob_seqs = 0  # sequences held with a prompt (prompt logprobs)
        self._alloc_rows(max_num_seqs)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._any_dirty = False  # some row's dirty_from >= 0
        self.keep_diffs = keep_diffs  # False: take_block_diff() is always empty

    # per-row columns: name -> (dtype, value of a free row)
    _COLUMNS: dict[str, tuple[type, float]] = {
        "num_blocks": (np.int64, 0), "prompt_len": (np.int64, 0), "num_tokens": (np.int64, 0),
        "temperature": (np.float32, 0.0), "top_k": (np.int32, 0), "top_p": (np.float32, 1.0),
        "min_p": (np.float32, 0.0), "rng_key": (np.int64, 0), "num_logprobs": (np.int32, -1),
        "num_prompt_logprobs": (np.int32, -1),
        "penalty_slot": (np.int64, -1), "repetition_penalty": (np.float32, 1.0),
        "frequency_penalty": (np.float32, 0.0), "presence_penalty": (np.float32, 0.0),
        "features": (np.int64, 0), "lora_slot": (np.int64, -1), "dirty_from": (np.int64, -1),
    }

    def _alloc_rows(self, n: int) -> None:
        """Columns for `n` rows, keeping what the first rows hold (start-up, or doubling)."""
        old = self.num_rows if hasattr(self, "num_blocks") else 0
        table = np.zeros((n, self.max_blocks_per_seq), dtype=np.int32)
        if old:
            table[:old] = self.block_table
        if self.device_is_host:  # the device table is the host table itself
            device_table = torch.from_numpy(table)
        else:
            device_table = torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32,
                                       device=self.device)
            if old:
                device_table[:old] = self.device_block_table
        self.block_table, self.device_block_table = table, device_table
        for name, (dtype, fill) in self._COLUMNS.items():
            column = np.full(n, fill, dtype=dtype)
            if old:
                column[:old] = getattr(self, name)
            setattr(self, name, column)

    @property
    def num_rows(self) -> int:
        return int(self.num_blocks.shape[0])

    # ---- the plan's state diffs ----------------------------------------------------------

    def drop(self, seq_ids: list[int]) -> None:
        """Forget finished, aborted and preempted sequences (unknown ids: no-op)."""
        for seq_id in seq_ids:
            state = self.seqs.pop(seq_id, None)
            if state is None:
                continue
            row = state.row
            self.seq_rows.set(seq_id, -1)
            self.dirty_from[row] = -1
            self.num_blocks[row] = 0
            if state.penalty_slot >= 0:
                self.penalties.release(state.penalty_slot)
                self.penalty_slot[row] = -1
            if state.prompt_ids is not None:
                self.num_prompt_logprob_seqs -= 1
                self.num_prompt_logprobs[row] = -1
            self.lora_slot[row] = -1
            self.free_rows.append(row)

    def apply(self, plan: StepPlan) -> None:
        """New sequences, then appended blocks, then replaced tables."""
        if plan.new_seqs:
            rows = np.fromiter(map(self._add, plan.new_seqs), np.int64, len(plan.new_seqs))
            self._write_blocks(np.fromiter((n.seq_id for n in plan.new_seqs), np.int64,
                                           rows.shape[0]), rows, None,
                               [n.block_table for n in plan.new_seqs])
        for diffs, at_end in ((plan.appended_blocks, True), (plan.replaced_tables, False)):
            if diffs:
                seq_ids = np.fromiter(diffs, np.int64, len(diffs))
                rows = self.rows_of(seq_ids)
                self._write_blocks(seq_ids, rows, self.num_blocks[rows] if at_end else None,
                                   list(diffs.values()))

    def _add(self, new: NewSeq) -> int:
        """A row for the new sequence, with its settings (its block table: `_write_blocks`)."""
        if new.seq_id in self.seqs:
            raise ValueError(f"NewSeq for seq {new.seq_id}, which already has state; the plan "
                             "must drop it first")
        if not self.free_rows:
            old = self.num_rows
            self._alloc_rows(2 * old)
            self.free_rows.extend(range(2 * old - 1, old - 1, -1))
        row = self.free_rows.pop()
        p = new.sampling_params
        computed = new.computed_token_ids
        slot = -1
        if p.uses_penalties:
            slot = self.penalties.acquire(computed[:new.prompt_len], computed[new.prompt_len:],
                                          p.logit_bias)
        prompt_ids = None
        if new.prompt_token_ids is not None:
            if p.prompt_logprobs is None or len(new.prompt_token_ids) != new.prompt_len:
                raise ValueError(f"NewSeq for seq {new.seq_id} carries a prompt of "
                                 f"{len(new.prompt_token_ids)} tokens (prompt_len "
                                 f"{new.prompt_len}, prompt_logprobs {p.prompt_logprobs}); a "
                                 "prompt comes only with prompt_logprobs, whole")
            prompt_ids = np.asarray(new.prompt_token_ids, dtype=np.int64)
            self.num_prompt_logprob_seqs += 1
        self.seqs[new.seq_id] = SeqState(row, new.request_id, slot, prompt_ids)
        self.num_prompt_logprobs[row] = -1 if prompt_ids is None else p.prompt_logprobs
        self.seq_rows.set(new.seq_id, row)
        self.prompt_len[row] = new.prompt_len
        self.num_tokens[row] = len(computed)
        self.temperature[row] = 0.0 if p.greedy else p.temperature
        self.top_k[row] = p.top_k if 0 < p.top_k < self.vocab_size else 0
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.rng_key[row] = (stream_key(p.seed, new.seq_index) if p.seed is not None
                             else stream_key(self.seed, _UNSEEDED_STREAM + new.seq_id))
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.penalty_slot[row] = slot
        self.lora_slot[row] = new.lora_slot
        self.repetition_penalty[row] = p.repetition_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.presence_penalty[row] = p.presence_penalty
        random = not p.greedy
        self.features[row] = (
            (RANDOM if random else 0) | (TOP_K if random and self.top_k[row] else 0)
            | (TOP_P if random and p.top_p < 1.0 else 0)
            | (MIN_P if random and p.min_p > 0.0 else 0)
            | (LOGPROBS if p.logprobs is not None else 0) | (PENALTIES if slot >= 0 else 0))
        return row

    def _write_blocks(self, seq_ids: np.ndarray, rows: np.ndarray, starts: np.ndarray | None,
                      tables: list[list[int]]) -> None:
        """Write `tables[i]` into row `rows[i]` from column `starts[i]` (None: whole new tables,
        from column 0), each sequence's table ending there; every id is checked first."""
        n = rows.shape[0]
        lens = np.fromiter(map(len, tables), np.int64, n)
        if starts is None:
            starts = np.zeros(n, dtype=np.int64)
        ends = starts + lens
        if n and int(ends.max()) > self.max_blocks_per_seq:
            i = int(np.argmax(ends > self.max_blocks_per_seq))
            raise ValueError(f"seq {int(seq_ids[i])} would have {int(ends[i])} blocks; "
                             f"max_model_len={self.max_model_len} allows "
                             f"{self.max_blocks_per_seq}")
        total = int(lens.sum())
        if total:
            ids = np.fromiter(chain.from_iterable(tables), np.int64, total)
            bad = (ids < 0) | (ids >= self.num_gpu_blocks)
            if bad.any():
                j = int(np.argmax(bad))
                owner = int(seq_ids[np.searchsorted(np.cumsum(lens), j, side="right")])
                raise ValueError(f"seq {owner}'s block table names block {int(ids[j])}; the "
                                 f"cache has {self.num_gpu_blocks} blocks")
            at_rows, cols = _ragged(rows, starts, lens, total)
            self.block_table[at_rows, cols] = ids
        self.num_blocks[rows] = ends
        if not self.keep_diffs:
            return
        dirty = self.dirty_from[rows]
        self.dirty_from[rows] = np.where((dirty >= 0) & (dirty < starts), dirty, starts)
        self._any_dirty = True

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The KV slot of each token (its row's table entry at position // block_size, times
        block_size, plus the offset), int64: the table is int32, a slot id need not be."""
        bs = self.block_size
        block, offset = np.divmod(positions, bs)
        block += rows * self.max_blocks_per_seq  # (the entry's flat index: a 1-d take)
        slots = self.block_table.reshape(-1).take(block).astype(np.int64)
        slots *= bs
        slots += offset
        return slots

    def rows_of(self, seq_ids: np.ndarray) -> np.ndarray:
        """Rows of a step's sequences; ValueError naming the first one without state."""
        rows = self.seq_rows.lookup(seq_ids)
        if rows.min(initial=0) < 0:
            missing = int(seq_ids[int(np.argmin(rows))])
            raise ValueError(f"the plan names seq {missing}, which has no state on this worker "
                             "(never sent as NewSeq, or already dropped)")
        return rows

    def take_block_diff(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, columns, block ids) written since the last call, flat int64, for the device."""
        if not self._any_dirty:
            return _EMPTY, _EMPTY, _EMPTY
        self._any_dirty = False
        rows = np.flatnonzero(self.dirty_from >= 0)
        starts = self.dirty_from[rows]
        self.dirty_from[rows] = -1
        lens = np.maximum(self.num_blocks[rows] - starts, 0)
        at_rows, cols = _ragged(rows, starts, lens, int(lens.sum()))
        return at_rows, cols, self.block_table[at_rows, cols].astype(np.int64)


_EMPTY = np.zeros(0, dtype=np.int64)


def _ragged(rows: np.ndarray, starts: np.ndarray, lens: np.ndarray,
            total: int) -> tuple[np.ndarray, np.ndarray]:
    """The (row, column) of each entry of `lens[i]` columns from `starts[i]` in `rows[i]`."""
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(rows, lens), np.repeat(starts, lens) + offsets
