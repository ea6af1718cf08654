"""The draft model's per-step index arrays (workers/draft_runner.draft_entries): built on the
host from the plan, in proposal-index-major order, so that forward j of the draft reads
the right input (the row's last token, then its own previous proposal), writes K/V at the
verify row's reserved slot, and puts its token in the right placeholder and proposal cell."""

from __future__ import annotations

import numpy as np

from workers.draft_runner import draft_entries


def test_entries_chain_each_rows_proposals_in_order() -> None:
    # batch tokens: row A (table row 4) [last@10, D, D], row B a plain decode (no drafts),
    # row C (table row 2) [last@30, D, D, D]; token indices 0-2, 3, 4-7
    drafts = np.array([2, 0, 3])
    first = np.array([0, 3, 4])
    rows = np.array([4, 9, 2])
    positions = np.array([10, 11, 12, 50, 30, 31, 32, 33])
    slots = np.array([110, 111, 112, 350, 230, 231, 232, 233])
    e = draft_entries(drafts, first, rows, positions, slots, width=4)
    pos, slot, table_rows, src, fill, prop = (a.tolist() for a in e.i64)
    # j-major: (A,0) (C,0) | (A,1) (C,1) | (C,2)
    assert e.offsets == [0, 2, 4, 5]
    assert pos == [10, 30, 11, 31, 32]
    assert slot == [110, 230, 111, 231, 232]
    assert e.seq_lens.tolist() == [11, 31, 12, 32, 33]
    assert e.max_seq_lens == [31, 32, 33]
    assert table_rows == [4, 2, 4, 2, 2] and e.rows.tolist() == table_rows
    # forward 0 reads batch tokens; later ones the entry of the same row one index earlier
    assert src == [0, 4, 0, 1, 3]
    assert fill == [1, 5, 2, 6, 7]  # the DRAFT_TOKEN placeholders they fill
    assert prop == [0 * 4 + 0, 2 * 4 + 0, 0 * 4 + 1, 2 * 4 + 1, 2 * 4 + 2]
