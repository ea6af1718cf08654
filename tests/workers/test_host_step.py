"""The host side of a decode step (issue #43's cuts), piece by piece and without a model: the
seq-id window's sentinels, pending tokens resolved against the index column (and past it), a
CPU table that keeps no block diff, and a one-array staging group cast by assignment."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scheduler.plan import PENDING_TOKEN, NewSeq, StepPlan
from scheduler.sampling_params import SamplingParams
from workers.pending import PendingTokens
from workers.seq_table import SeqRows, SeqTable
from workers.staging import InputStager

GREEDY = SamplingParams(temperature=0)


def _plan(step: int, seq_ids: list[int], ids: list[int], **kw) -> StepPlan:
    n = len(seq_ids)
    return StepPlan(step, np.array(seq_ids, np.int64), np.ones(n, np.int32),
                    np.zeros(n, np.int32), np.array(ids, np.int64), np.ones(n, bool), **kw)


def test_seq_ids_outside_the_window_find_the_sentinels_not_a_neighbour() -> None:
    rows = SeqRows()
    first, last = 1, rows.rows.shape[0] - 2  # the window's first and last settable ids
    rows.set(first + rows.base, 5)
    rows.set(last + rows.base, 6)
    assert rows.rows[0] == -1 and rows.rows[-1] == -1  # (never set: the sentinels)
    ids = np.array([rows.base + first, rows.base + last, rows.base, rows.base - 7,
                    rows.base + rows.rows.shape[0] - 1, rows.base + 10**12, -(10**12)])
    assert rows.lookup(ids).tolist() == [5, 6, -1, -1, -1, -1, -1]
    rows.set(rows.base + rows.rows.shape[0] + 3, 7)  # past the end: a re-window, sentinels kept
    assert rows.rows[0] == -1 and rows.rows[-1] == -1
    assert rows.lookup(ids[:2]).tolist() == [5, 6]


def test_pending_tokens_resolve_every_row_or_name_the_seqs_that_did_not_sample() -> None:
    pending = PendingTokens(torch.device("cpu"), max_num_seqs=2)
    pending.record(0, np.array([1, 0]))
    plan = _plan(1, [10, 11], [PENDING_TOKEN, PENDING_TOKEN])
    ids, src = pending.resolve(plan, None, np.array([0, 1]), PENDING_TOKEN)
    assert ids.tolist() == [0, 0] and src.tolist() == [1, 0]
    pending.record(1, np.array([0, 7]))  # a row past the column (the table grew): it grows
    plan = _plan(2, [10, 11, 12], [5, PENDING_TOKEN, PENDING_TOKEN])
    ids, src = pending.resolve(plan, np.array([1, 2]), np.array([3, 7, 0]), PENDING_TOKEN)
    assert ids.tolist() == [5, 0, 0] and src.tolist() == [1, 0]
    pending.record(2, np.array([0]))
    plan = _plan(3, [10, 11, 12], [PENDING_TOKEN] * 3)
    with pytest.raises(ValueError, match=r"pending tokens for seqs \[11, 12\], which plan 2"):
        pending.resolve(plan, None, np.array([0, 7, 900]), PENDING_TOKEN)  # 900: past it


def test_a_table_without_diffs_writes_its_blocks_and_takes_nothing() -> None:
    table = SeqTable(max_num_seqs=2, block_size=4, max_model_len=32, vocab_size=64, seed=0,
                     device=torch.device("cpu"), keep_diffs=False)
    table.num_gpu_blocks = 50
    table.apply(_plan(0, [], [], new_seqs=[NewSeq(3, "r", 0, 4, [], [7, 8], GREEDY)]))
    table.apply(_plan(0, [], [], appended_blocks={3: [9]}))
    row = table.seqs[3].row
    assert table.block_table[row, :3].tolist() == [7, 8, 9]
    assert table.device_block_table[row, :3].tolist() == [7, 8, 9]  # (the same memory)
    assert [a.size for a in table.take_block_diff()] == [0, 0, 0]
    assert table.slots(np.array([row, row]), np.array([1, 9])).tolist() == [29, 37]


def test_a_one_array_group_is_cast_into_its_dtype() -> None:
    stager = InputStager(torch.device("cpu"), nbytes=256, depth=2)
    big = np.array([1, 2 ** 33 + 5, -3], dtype=np.int64)
    (i64, i32, f32), _ = stager.stage([None, big], [big], [np.array([0.5, 2.0])])
    assert i64[0] is None and i64[1].tolist() == big.tolist()
    assert i32[0].dtype == torch.int32 and i32[0].tolist() == [1, 5, -3]  # (wrapped as astype)
    assert f32[0].dtype == torch.float32 and f32[0].tolist() == [0.5, 2.0]
    (_, i32, _), _ = stager.stage([], [np.zeros(0, np.int64)], [])  # an empty group: nothing
    assert i32[0].tolist() == []
