"""Async scheduling on a worker: pending input tokens, gathered on the device.

With async scheduling a plan may name, as the input of a decode, the token the plan just
before it samples for that sequence (`PENDING_TOKEN`, see scheduler/plan.py): the scheduler
does not know it yet, and the worker never copies it to the host to find out. This module is
the worker side of that protocol, all of it:
- `record` remembers, after each step, the device tensor of its sampled ids and at which index
  each sampled row's token sits (a column by table row, so lookups are numpy gathers);
- `resolve` checks a plan's pending tokens against the step before it (ValueError for a plan
  that names a step or a sequence that did not sample) and maps each to its source index;
- `fill` gathers the pending ids from the last sampled tensor on the device into the step's
  staged input ids; with tp > 1 rank 0 broadcasts them (one small collective per step that has
  any), since only rank 0 samples: broadcasting a few ids is cheaper than gathering every
  logit to every rank so that all could sample identically.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from scheduler.plan import PENDING_TOKEN, StepPlan
from workers.distributed import TensorParallelGroup
from workers.pipeline import OutputBroadcast

_NONE = np.zeros(0, dtype=np.int64)


class PendingTokens:
    """The last step's sampled ids on the device, and the rows they belong to."""

    def __init__(self, device: torch.device, max_num_seqs: int) -> None:
        self.device = device
        self.last_step_id: int | None = None
        self._tokens = torch.zeros(0, dtype=torch.int64, device=device)
        # index of each table row's token in the last sampled ids (-1: none); its last entry
        # is a sentinel never set, which `resolve` clips rows past the column to
        self._index_of_row = np.full(max_num_seqs + 1, -1, dtype=np.int64)
        self._rows = _NONE  # the rows that sampled in the last step
        self._order = np.arange(max_num_seqs, dtype=np.int64)  # (record's index values)
        self._values = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)

    def record(self, step_id: int, sample_rows: np.ndarray) -> None:
        """Step `step_id` is prepared and samples these table rows, in this order (a step
        that samples nothing: an empty array)."""
        self.last_step_id = step_id
        index = self._index_of_row
        if self._rows.size:
            index[self._rows] = -1
        n = sample_rows.shape[0]
        if n:
            if n > self._order.shape[0]:
                self._order = np.arange(2 * n, dtype=np.int64)
            try:
                index[:-1][sample_rows] = self._order[:n]
            except IndexError:  # a row past the column (the table grew): grow it
                grown = np.full(2 * (int(sample_rows.max()) + 1) + 1, -1, dtype=np.int64)
                grown[:index.shape[0] - 1] = index[:-1]
                self._index_of_row = index = grown
                index[sample_rows] = self._order[:n]
        self._rows = sample_rows

    def sampled(self, tokens: Tensor) -> None:
        """The device tensor of the recorded step's sampled ids (set once it has sampled)."""
        self._tokens = tokens

    def reset(self) -> None:
        """Nothing may name a pending token before the next step (start-up, warm-up)."""
        self.record(-1, _NONE)
        self.last_step_id = None

    def resolve(self, plan: StepPlan, pending: np.ndarray | None, token_rows: np.ndarray,
                lowest: int) -> tuple[np.ndarray, np.ndarray]:
        """(plan.input_ids with the pending ones zeroed, each pending token's index in the
        last step's sampled ids); call before `record` of this step. `pending`: the pending
        tokens' indices in the step's tokens (None: every token). `lowest` is the smallest
        input id (pending tokens are the negative ones)."""
        input_ids = plan.input_ids
        if lowest < PENDING_TOKEN:
            raise ValueError(f"plan {plan.step_id} has negative token ids other than "
                             f"PENDING_TOKEN ({PENDING_TOKEN})")
        last = -1 if self.last_step_id is None else self.last_step_id
        if last != plan.step_id - 1:
            raise ValueError(f"plan {plan.step_id} has pending tokens, but the last plan "
                             f"this worker sampled for was {last}")
        rows = token_rows if pending is None else token_rows[pending]
        src = self._index_of_row.take(rows, mode="clip")  # (past the column: the sentinel)
        if src.min() < 0:
            if pending is None:
                pending = np.arange(token_rows.shape[0])
            ends = np.cumsum(plan.query_lens)
            owners = plan.seq_ids[np.searchsorted(ends, pending, side="right")]
            raise ValueError(f"plan {plan.step_id} has pending tokens for seqs "
                             f"{owners[src < 0].tolist()}, which plan {last} did not sample")
        return np.maximum(input_ids, 0), src  # (the pending ids, the only negative ones, -> 0)

    def fill(self, input_ids: Tensor, positions: Tensor | None, sources: Tensor,
             tp: TensorParallelGroup | OutputBroadcast) -> None:
        """input_ids[positions] = the last step's sampled ids at `sources` (on the device);
        positions None: every token row is pending (a decode step's), gathered in place."""
        n = sources.shape[0]
        if positions is None:
            values = input_ids if input_ids.shape[0] == n else input_ids[:n]
        else:
            if n > self._values.shape[0]:
                self._values = torch.zeros(2 * n, dtype=torch.int64, device=self.device)
            values = self._values[:n]
        if tp.is_first:
            torch.index_select(self._tokens, 0, sources, out=values)
        tp.broadcast_from_first(values)
        if positions is not None:
            input_ids.index_copy_(0, positions, values)
