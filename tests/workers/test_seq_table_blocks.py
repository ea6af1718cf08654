"""The persistent batch's block tables (workers/seq_table.py): a plan's block writes, made with
numpy over all its sequences at once, and the diff the device table follows (taken per step,
one write per entry). A "device" copy here is a plain array the diffs are scattered into, as
the model runner scatters them into the GPU's table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scheduler.plan import NewSeq, StepPlan
from scheduler.sampling_params import SamplingParams
from workers.seq_table import SeqTable

BLOCK = 4
GREEDY = SamplingParams(temperature=0)


def _table(max_num_seqs: int = 4) -> SeqTable:
    table = SeqTable(max_num_seqs=max_num_seqs, block_size=BLOCK, max_model_len=10 * BLOCK,
                     vocab_size=64, seed=0, device=torch.device("cpu"))
    table.num_gpu_blocks = 100
    return table


def _plan(**kw) -> StepPlan:
    empty = np.zeros(0, dtype=np.int64)
    return StepPlan(0, empty, empty.astype(np.int32), empty.astype(np.int32), empty,
                    np.zeros(0, dtype=bool), **kw)


def _new(seq_id: int, blocks: list[int]) -> NewSeq:
    return NewSeq(seq_id, f"r{seq_id}", 0, len(blocks) * BLOCK, [], blocks, GREEDY)


def _follow(table: SeqTable, device: np.ndarray) -> tuple[int, int]:
    """Scatter the taken diff into `device`; (entries written, distinct entries)."""
    rows, cols, ids = table.take_block_diff()
    device[rows, cols] = ids
    return rows.shape[0], len(set(zip(rows.tolist(), cols.tolist())))


def _tables(table: SeqTable, seq_ids: list[int], of: np.ndarray) -> dict[int, list[int]]:
    out = {}
    for s in seq_ids:
        row = table.seqs[s].row
        out[s] = of[row, :int(table.num_blocks[row])].tolist()
    return out


def test_a_plans_block_writes_land_and_the_device_copy_follows_the_diffs() -> None:
    table = _table(max_num_seqs=2)
    table.apply(_plan(new_seqs=[_new(1, [10, 11]), _new(2, [20]), _new(3, [])]))
    assert table.num_rows == 4  # (the third sequence grew the rows)
    device = np.zeros_like(table.block_table)
    assert _follow(table, device) == (3, 3)
    table.apply(_plan(appended_blocks={2: [21, 22], 1: [12], 3: [30]}))
    assert _follow(table, device) == (4, 4)  # only the appended entries
    table.apply(_plan(appended_blocks={1: [13]}, replaced_tables={1: [40, 41, 42, 43, 44]}))
    assert _follow(table, device) == (5, 5)  # the replaced table once, not also the append
    want = {1: [40, 41, 42, 43, 44], 2: [20, 21, 22], 3: [30]}
    assert _tables(table, [1, 2, 3], table.block_table) == want
    assert _tables(table, [1, 2, 3], device) == want
    assert _follow(table, device) == (0, 0)  # nothing written since


def test_a_dropped_row_reused_in_the_same_step_sends_only_its_new_table() -> None:
    table = _table()
    device = np.zeros_like(table.block_table)
    table.apply(_plan(new_seqs=[_new(1, [10, 11, 12])]))
    _follow(table, device)
    table.apply(_plan(appended_blocks={1: [13]}))  # an empty plan's diff waits for a step
    table.drop([1])
    table.apply(_plan(new_seqs=[_new(2, [50])]))
    assert table.seqs[2].row == 0  # the dropped sequence's row
    assert _follow(table, device) == (1, 1)
    assert _tables(table, [2], device) == {2: [50]}


@pytest.mark.parametrize("plan, message", [
    (dict(appended_blocks={1: [5], 7: [6]}), "names seq 7, which has no state"),
    (dict(appended_blocks={1: list(range(20, 28))}), "seq 1 would have 11 blocks"),
    (dict(appended_blocks={1: [5], 2: [6, 100]}), "seq 2's block table names block 100"),
    (dict(replaced_tables={2: [-1]}), "seq 2's block table names block -1"),
    (dict(new_seqs=[_new(3, [1, 2, 100])]), "seq 3's block table names block 100"),
])
def test_a_bad_block_write_is_a_value_error_that_writes_nothing(plan: dict,
                                                                 message: str) -> None:
    table = _table()
    table.apply(_plan(new_seqs=[_new(1, [10, 11, 12]), _new(2, [20])]))
    table.take_block_diff()
    before = table.block_table.copy()
    with pytest.raises(ValueError, match=message):
        table.apply(_plan(**plan))
    assert np.array_equal(table.block_table, before)
    assert [int(table.num_blocks[table.seqs[s].row]) for s in (1, 2)] == [3, 1]
