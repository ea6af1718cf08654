"""The StepPlan under construction."""

from __future__ import annotations

import numpy as np

from scheduler.plan import NewSeq, StepPlan, empty_pairs


class StepBuilder:
    """The plan being built by one `schedule()` call: batch entries in two lists (decodes,
    then prefill chunks) and the table / swap / copy diffs, turned into arrays once."""

    __slots__ = ("step_id", "budget", "seq_slots", "preempted", "lane", "dec_ids", "dec_pos",
                 "dec_tokens", "pre_ids", "pre_lens", "pre_pos", "pre_sample", "pre_tokens",
                 "new_seqs", "appended", "replaced", "dropped", "swap_out", "swap_in", "copies")

    def __init__(self, step_id: int, budget: int, seq_slots: int, dropped: list[int]) -> None:
        self.step_id = step_id
        self.budget = budget
        self.seq_slots = seq_slots
        self.preempted = False
        # The decode lane's rows (seq ids, positions, input ids), which come first, as arrays
        self.lane: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.dec_ids: list[int] = []
        self.dec_pos: list[int] = []
        self.dec_tokens: list[int] = []
        self.pre_ids: list[int] = []
        self.pre_lens: list[int] = []
        self.pre_pos: list[int] = []
        self.pre_sample: list[bool] = []
        self.pre_tokens: list[int] = []
        self.new_seqs: list[NewSeq] = []
        self.appended: dict[int, list[int]] = {}
        self.replaced: dict[int, list[int]] = {}
        self.dropped = dropped
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.copies: list[tuple[int, int]] = []

    def to_plan(self) -> StepPlan:
        nd = len(self.dec_ids)
        seq_ids = np.array(self.dec_ids + self.pre_ids, dtype=np.int64)
        start_pos = np.array(self.dec_pos + self.pre_pos, dtype=np.int32)
        input_ids = np.array(self.dec_tokens + self.pre_tokens, dtype=np.int64)
        num_lane = 0
        if self.lane is not None:
            lane_ids, lane_pos, lane_tokens = self.lane
            num_lane = len(lane_ids)
            seq_ids = np.concatenate((lane_ids, seq_ids))
            start_pos = np.concatenate((lane_pos, start_pos)).astype(np.int32, copy=False)
            input_ids = np.concatenate((lane_tokens, input_ids))
        query_lens = np.ones(len(seq_ids), dtype=np.int32)
        query_lens[num_lane + nd:] = self.pre_lens
        do_sample = np.ones(len(seq_ids), dtype=bool)
        do_sample[num_lane + nd:] = self.pre_sample
        return StepPlan(
            step_id=self.step_id,
            seq_ids=seq_ids,
            query_lens=query_lens,
            start_pos=start_pos,
            input_ids=input_ids,
            do_sample=do_sample,
            new_seqs=self.new_seqs,
            appended_blocks=self.appended,
            replaced_tables=self.replaced,
            dropped_seq_ids=self.dropped,
            swap_out=_pairs(self.swap_out),
            swap_in=_pairs(self.swap_in),
            copies=_pairs(self.copies),
        )


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.array(pairs, dtype=np.int64).reshape(-1, 2) if pairs else empty_pairs()
