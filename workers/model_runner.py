"""Turns StepPlans into forward passes: per-sequence state, batch tensors, logits for samplers.

State per sequence lives from its `NewSeq` to its drop: a row of a persistent block-table
array (appended to / replaced by later plans, so a plan carries only diffs), its prompt
length and sampling params, and, only for sequences with penalties, its token history.
Per step the host work is O(batch) numpy, never proportional to the total context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from scheduler.plan import NewSeq, StepPlan
from scheduler.sampling_params import SamplingParams
from workers.cuda_graph import CUDAGraphRunner
from workers.layers.attention import AttentionMetadata
from workers.qwen3 import Qwen3ForCausalLM
from workers.sampler import SamplingMetadata


@dataclass(slots=True)
class SeqState:
    """What a worker remembers about one running sequence between plans."""

    row: int  # row of ModelRunner.block_table
    prompt_len: int
    seq_index: int
    params: SamplingParams
    tokens: np.ndarray | None  # int64 history (capacity-padded); only when penalties are used
    num_tokens: int  # length of the history (every token computed so far)


@dataclass(slots=True)
class ModelInput:
    """One step's device tensors and the host facts the sampler needs."""

    input_ids: Tensor
    positions: Tensor
    attn_metadata: AttentionMetadata
    logits_indices: Tensor  # rows of the hidden states to compute logits for (do_sample)
    sample_states: list[SeqState]
    output_indices: list[int]  # per sampled sequence: tokens it generated before this one


class ModelRunner:
    """Keeps sequence state and runs the model for a plan; no scheduling decisions."""

    def __init__(self, model: Qwen3ForCausalLM, device: torch.device, block_size: int,
                 max_model_len: int, max_num_seqs: int) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.block_table = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.seqs: dict[int, SeqState] = {}
        self.num_gpu_blocks = 0  # set by the worker once the cache exists
        self.graph_runner: CUDAGraphRunner | None = None

    # ---- state diffs ----------------------------------------------------------------------

    def drop_states(self, seq_ids: list[int]) -> None:
        """Step 1 of a plan: forget finished, aborted and preempted sequences (unknown ids: no-op)."""
        for seq_id in seq_ids:
            state = self.seqs.pop(seq_id, None)
            if state is not None:
                self.num_blocks[state.row] = 0
                self.free_rows.append(state.row)

    def add_states(self, plan: StepPlan) -> None:
        """Step 3 of a plan: new sequences, then appended blocks, then replaced tables."""
        for new in plan.new_seqs:
            self._add(new)
        for seq_id, blocks in plan.appended_blocks.items():
            state = self._state(seq_id)
            start = int(self.num_blocks[state.row])
            self._write_blocks(seq_id, state.row, start, blocks)
        for seq_id, table in plan.replaced_tables.items():
            state = self._state(seq_id)
            self._write_blocks(seq_id, state.row, 0, table)

    def _add(self, new: NewSeq) -> None:
        if new.seq_id in self.seqs:
            raise ValueError(f"NewSeq for seq {new.seq_id}, which already has state; the plan "
                             "must drop it first")
        if not self.free_rows:
            self._grow()
        row = self.free_rows.pop()
        tokens = None
        if new.sampling_params.uses_penalties:
            tokens = np.asarray(new.computed_token_ids, dtype=np.int64)
        self.seqs[new.seq_id] = SeqState(row, new.prompt_len, new.seq_index, new.sampling_params,
                                         tokens, len(new.computed_token_ids))
        self._write_blocks(new.seq_id, row, 0, new.block_table)

    def _write_blocks(self, seq_id: int, row: int, start: int, blocks: list[int]) -> None:
        end = start + len(blocks)
        if end > self.max_blocks_per_seq:
            raise ValueError(f"seq {seq_id} would have {end} blocks; max_model_len="
                             f"{self.max_model_len} allows {self.max_blocks_per_seq}")
        self.block_table[row, start:end] = blocks
        self.num_blocks[row] = end

    def _grow(self) -> None:
        """More rows than max_num_seqs are alive (e.g. many preempted at once): double the table."""
        old = self.block_table.shape[0]
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        self.free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _state(self, seq_id: int) -> SeqState:
        state = self.seqs.get(seq_id)
        if state is None:
            raise ValueError(f"the plan names seq {seq_id}, which has no state on this worker "
                             "(never sent as NewSeq, or already dropped)")
        return state

    # ---- inputs ---------------------------------------------------------------------------

    def prepare_inputs(self, plan: StepPlan, input_ids: np.ndarray | None = None) -> ModelInput:
        """Positions, slot mapping, block tables and query/context lengths of the batch.

        `input_ids` replaces plan.input_ids: the worker's copy with pending tokens filled in.
        """
        if input_ids is None:
            input_ids = plan.input_ids
        num_seqs, bs = plan.num_seqs, self.block_size
        states = [self._state(s) for s in plan.seq_ids.tolist()]
        query_lens = plan.query_lens.astype(np.int64)
        start_pos = plan.start_pos.astype(np.int64)
        if query_lens.shape != (num_seqs,) or start_pos.shape != (num_seqs,) \
                or plan.do_sample.shape != (num_seqs,):
            raise ValueError("plan.query_lens, start_pos and do_sample must each have one entry "
                             f"per sequence ({num_seqs})")
        if (query_lens < 1).any():
            raise ValueError(f"every scheduled sequence computes >= 1 token; query_lens={query_lens}")
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        if plan.num_tokens != num_tokens:
            raise ValueError(f"plan.input_ids has {plan.num_tokens} tokens; query_lens sum to "
                             f"{num_tokens}")
        seq_lens = start_pos + query_lens
        if seq_lens.max() > self.max_model_len:
            raise ValueError(f"a sequence reaches {int(seq_lens.max())} tokens; "
                             f"max_model_len is {self.max_model_len}")
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=num_seqs)
        need = (seq_lens + bs - 1) // bs
        short = need > self.num_blocks[rows]
        if short.any():
            i = int(np.argmax(short))
            raise ValueError(f"seq {int(plan.seq_ids[i])} needs {int(need[i])} blocks for "
                             f"{int(seq_lens[i])} tokens; its block table has "
                             f"{int(self.num_blocks[rows[i]])}")
        block_tables = self.block_table[rows, :int(need.max())]
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens) + np.repeat(start_pos - cu[:-1], query_lens)
        slots = (block_tables[seq_of_token, positions // bs].astype(np.int64) * bs
                 + positions % bs)
        if block_tables.size and int(block_tables.max()) >= self.num_gpu_blocks:
            raise ValueError(f"a block table names block {int(block_tables.max())}; the cache "
                             f"has {self.num_gpu_blocks} blocks")
        if (input_ids < 0).any():
            raise ValueError(f"plan {plan.step_id} has pending or negative token ids; the worker "
                             "resolves pending tokens before preparing inputs")
        self._extend_histories(states, input_ids, cu)
        sample = np.flatnonzero(plan.do_sample)
        sample_states = [states[i] for i in sample]
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=_to(slots, dev),
            block_tables=_to(block_tables, dev),
            query_start_loc=_to(cu.astype(np.int32), dev),
            seq_lens=_to(seq_lens.astype(np.int32), dev),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()))
        return ModelInput(
            input_ids=_to(input_ids.astype(np.int64, copy=False), dev),
            positions=_to(positions, dev),
            attn_metadata=md,
            logits_indices=_to(cu[1:][sample] - 1, dev),
            sample_states=sample_states,
            output_indices=[int(seq_lens[i]) - st.prompt_len for i, st in zip(sample, sample_states)])

    def _extend_histories(self, states: list[SeqState], input_ids: np.ndarray,
                          cu: np.ndarray) -> None:
        for i, state in enumerate(states):
            new = int(cu[i + 1] - cu[i])
            if state.tokens is not None:
                end = state.num_tokens + new
                if end > state.tokens.shape[0]:
                    grown = np.empty(max(end, 2 * state.tokens.shape[0], 64), dtype=np.int64)
                    grown[:state.num_tokens] = state.tokens[:state.num_tokens]
                    state.tokens = grown
                state.tokens[state.num_tokens:end] = input_ids[cu[i]:cu[i + 1]]
            state.num_tokens += new

    # ---- forward --------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, plan: StepPlan,
                      input_ids: np.ndarray | None = None) -> tuple[Tensor | None, ModelInput]:
        """Run the batch; logits `[S, vocab]` of the sampled sequences on rank 0 (None elsewhere,
        and None everywhere when no sequence samples this step)."""
        inp = self.prepare_inputs(plan, input_ids)
        md = inp.attn_metadata
        if self.graph_runner is not None and self.graph_runner.can_run(plan.num_seqs,
                                                                        md.max_query_len):
            hidden = self.graph_runner.run(inp.input_ids, inp.positions, md)
        else:
            hidden = self.model(inp.input_ids, inp.positions, md)
        if not inp.sample_states:
            return None, inp
        return self.model.compute_logits(hidden[inp.logits_indices]), inp

    def sampling_metadata(self, inp: ModelInput, vocab_size: int) -> SamplingMetadata:
        states = inp.sample_states
        return SamplingMetadata.build(
            [s.params for s in states], [s.seq_index for s in states], inp.output_indices,
            [(s.tokens[:s.num_tokens], s.prompt_len) if s.tokens is not None else None
             for s in states],
            vocab_size, self.device)


def _to(array: np.ndarray, device: torch.device) -> Tensor:
    t = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
