"""The StepPlan under construction: what one schedule() call has decided so far."""

from __future__ import annotations

import numpy as np

from kvcache import Allocation, KVCacheManager
from scheduler.plan import PENDING_TOKEN, LoRALoad, NewSeq, StepPlan, empty_pairs
from scheduler.request import Request, Seq


class StepBuilder:
    """The plan being built by one `schedule()` call: batch entries in two lists (decodes,
    then prefill chunks) and the table / swap / copy diffs, turned into arrays once."""

    __slots__ = ("step_id", "budget", "seq_slots", "preempted", "lane", "dec_ids", "dec_pos",
                 "dec_tokens", "pre_ids", "pre_lens", "pre_pos", "pre_sample", "pre_tokens", "pre_drafts",
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
        self.pre_drafts: list[int] | None = None  # proposals per chunk, once a verify row exists
        self.new_seqs: list[NewSeq] = []
        self.appended: dict[int, list[int]] = {}
        self.replaced: dict[int, list[int]] = {}
        self.dropped = dropped
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.copies: list[tuple[int, int]] = []

    def cap_prefill(self, max_mixed_prefill_tokens: int | None) -> None:
        """After stage 1: when the step already carries rows (decodes, verify rows, forks),
        leave at most `max_mixed_prefill_tokens` of the budget to the prompt chunks that
        follow, so every stream decoding in this step waits for a bounded prefill; a step
        without rows keeps the whole budget (None: no cap)."""
        rows = len(self.dec_ids) + len(self.pre_ids) + (0 if self.lane is None
                                                         else len(self.lane[0]))
        if max_mixed_prefill_tokens is not None and rows:
            self.budget = min(self.budget, max_mixed_prefill_tokens)

    def add(self, req: Request, seq: Seq, alloc: Allocation, start: int, chunk: int,
            kv: KVCacheManager, drafts: list[int] | None = None) -> None:
        """Add a scheduled chunk of `chunk` tokens from position `start`, its slots reserved
        by `alloc` (a decode when it is the sequence's next token; a verify row when `drafts`,
        proposed tokens, follow that token): batch entry, table diff, copy-on-write pairs, the
        budget. Advances seq.num_computed."""
        sid = seq.seq_id
        seq.num_computed = end = start + chunk
        req.scheduled_step = self.step_id
        self.budget -= chunk
        self.seq_slots -= 1
        copies = alloc.copies
        if seq.on_worker and not copies:
            if alloc.new_block_ids:
                self.appended[sid] = alloc.new_block_ids
        elif not seq.on_worker:
            sp = req.sampling_params
            self.new_seqs.append(NewSeq(
                sid, req.request_id, seq.index, seq.prompt_len, seq.token_ids[:start],
                list(kv.block_table(sid)), sp,
                prompt_token_ids=(req.prompt_token_ids if sp.prompt_logprobs is not None
                                  and seq.index == 0 else None),
                lora_slot=req.lora_slot))
            seq.on_worker = True
        else:
            self.replaced[sid] = list(kv.block_table(sid))
        if copies:
            self.copies.extend(copies)
        tokens = seq.token_ids
        num_known = len(tokens)
        if drafts:  # a verify row: its last known token, then the proposals
            if self.pre_drafts is None:
                self.pre_drafts = [0] * len(self.pre_ids)
            self.pre_ids.append(sid)
            self.pre_lens.append(chunk)
            self.pre_pos.append(start)
            self.pre_sample.append(True)
            self.pre_tokens.append(tokens[start])
            self.pre_tokens.extend(drafts)
            self.pre_drafts.append(len(drafts))
        elif chunk == 1 and end >= num_known:  # a decode (end > num_known: its token in flight)
            self.dec_ids.append(sid)
            self.dec_pos.append(start)
            # the token in flight is PENDING_TOKEN to the workers (scheduler/ahead.py)
            self.dec_tokens.append(tokens[start] if start < num_known else PENDING_TOKEN)
        else:
            self.pre_ids.append(sid)
            self.pre_lens.append(chunk)
            self.pre_pos.append(start)
            self.pre_sample.append(end == len(tokens))
            self.pre_tokens.extend(tokens[start:end])
            if self.pre_drafts is not None:
                self.pre_drafts.append(0)

    def to_plan(self, offload: list[tuple[int, int]], load: list[tuple[int, int]],
                lora_loads: list[LoRALoad]) -> StepPlan:
        """The plan, with the offload tier's copies of the step (KVCacheManager.take_transfers)
        and the adapters to load into device slots (LoRASlots.take_loads)."""
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
        num_draft = None
        if self.pre_drafts is not None:
            num_draft = np.zeros(len(seq_ids), dtype=np.int32)
            num_draft[num_lane + nd:] = self.pre_drafts
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
            offload=_pairs(offload),
            load=_pairs(load),
            num_draft_tokens=num_draft,
            lora_loads=lora_loads,
        )


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.array(pairs, dtype=np.int64).reshape(-1, 2) if pairs else empty_pairs()
