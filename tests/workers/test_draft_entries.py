"""The draft model's per-step index arrays (workers/draft_runner.draft_entries): built on the
host from the plan, in proposal-index-major order, so that forward j of the draft reads
the right input (the row's last token, then its own previous proposal), writes K/V at the
verify row's reserved slot, and puts its token in the right placeholder and proposal cell.
Also: the fit check before loading counts the draft's weights beside the target's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

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


def test_weights_fit_counts_the_drafts_shard(tmp_path: Path) -> None:
    """On a device where the target's shard fits and the target's plus the draft's do not,
    only the pair is refused, and the error names the draft."""
    from workers.model_config import load_model_config
    from workers.tiny_model import QWEN3_0_6B_CONFIG, QWEN3_30B_A3B_CONFIG, qwen3_config_dict
    from workers.worker import check_weights_fit

    configs = {}
    for name, cfg in (("target", QWEN3_30B_A3B_CONFIG), ("draft", QWEN3_0_6B_CONFIG)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(qwen3_config_dict(cfg)))
        configs[name] = load_model_config(tmp_path / name, 2)
    target, draft = configs["target"], configs["draft"]
    need_target = target.weight_bytes_per_rank(2, 2)
    need_draft = draft.weight_bytes_per_rank(2, 2)
    assert 0 < need_draft < need_target / 20  # a 0.6B beside a 30B
    device_bytes = int((need_target + need_draft // 2) / 0.9)
    check_weights_fit(target, 2, 2, device_bytes, 0.9)
    with pytest.raises(ValueError, match="with the draft .* at tensor_parallel_size=2"):
        check_weights_fit(target, 2, 2, device_bytes, 0.9, draft)
    check_weights_fit(target, 2, 2, int((need_target + need_draft) / 0.9) + 16, 0.9, draft)
