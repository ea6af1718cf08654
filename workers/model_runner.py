"""Turns a StepPlan into device inputs, a forward pass, logits and sampled tokens.

Per step the host does O(batch) numpy over the persistent batch (`workers/seq_table.py`),
packs every array into one staging buffer and sends it with one H2D copy
(`workers/staging.py`); block tables live on the device and change by the plan's diff. Pending
tokens (async scheduling) are filled on the device by the worker between `prepare` and
`forward`. Nothing here reads a device value on the host: a step can be launched while the
one before it still runs.

Decode batches (one token per sequence) and speculative verify batches (every sequence k + 1
tokens: its last token and the k proposals) replay a CUDA graph of the forward, the logits and,
for greedy/temperature-only batches, the sampling too (`workers/cuda_graph.py`); the graph's
static inputs are laid out as the staged ones are (padded per token row), so handing them
over is three copies.

Prompt logprobs are computed from the same forward's hidden states, a bounded slice of rows
at a time (workers/prompt_logprobs.py); a step with any never replays a graph.

A step sampling fewer rows than it computes runs the last layer for those rows only
(`OutputRows`, workers/qwen3.py), unless prompt logprobs, pooling or LoRA need every row.

LoRA (workers/lora/): each token's adapter slot is its sequence's (`SeqTable.lora_slot`), staged
with the step's other inputs and copied into the wrappers' persistent slot buffer before the
forward pass, graph or eager; an eager step none of whose sequences has an adapter skips the
LoRA products.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from scheduler.plan import DRAFT_TOKEN, StepPlan
from workers.cpu_threads import ThreadScope
from workers.cuda_graph import CUDAGraphRunner
from workers.distributed import TensorParallelGroup
from workers.draft_runner import DraftBatch, DraftRunner
from workers.layers.attention import AttentionMetadata, OutputRows
from workers.lora import LoRAModel
from workers.pending import PendingTokens
from workers.pipeline import OutputBroadcast, PipelineStage
from workers.pooler import Pooler
from workers.prompt_logprobs import compute_prompt_logprobs, select_prompt_rows
from workers.qwen3 import Qwen3ForCausalLM
from workers.sampler import PenaltyInputs, Sampler, SamplerOutput, SamplingMetadata
from workers.seq_table import LOGPROBS, MIN_P, RANDOM, TOP_K, TOP_P, SeqTable
from workers.staging import InputStager
from workers.step_batch import (
    NO_PENALTIES,
    StepBatch,
    draft_entries_for,
    lora_slots,
    max_top_k,
    output_row_arrays,
    padded,
    penalty_arrays,
    verify_rows,
)

_EMPTY = np.zeros(0, dtype=np.int64)


class ModelRunner:
    """Runs the model for a plan over the persistent batch; no scheduling decisions."""

    def __init__(self, model: Qwen3ForCausalLM, device: torch.device, block_size: int,
                 max_model_len: int, max_num_seqs: int, vocab_size: int, seed: int,
                 lora: LoRAModel | None = None, pooler: Pooler | None = None,
                 stage: PipelineStage | None = None, head: ThreadScope | None = None) -> None:
        self.model = model
        self.stage = stage or PipelineStage.single()  # a pipeline stage runs its layers only
        self.lora = lora
        self.pooler = pooler  # the pooling runner's (no sampling); None: generate
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.table = SeqTable(max_num_seqs, block_size, max_model_len, vocab_size, seed, device,
                              keep_diffs=device.type != "cpu")  # (CPU: the table is the host's)
        self.stager = InputStager(device)
        self.pending = PendingTokens(device, max_num_seqs)
        self.bitmask_stager = InputStager(device, nbytes=1 << 16)
        # query_start_loc of a batch of one-token sequences, by batch size (views of one arange)
        self._one_token_cu: dict[int, Tensor] = {}
        self._arange = torch.arange(max(max_num_seqs, 1) * 4 + 1, dtype=torch.int32,
                                    device=device)
        self._no_slots = torch.zeros(0, dtype=torch.int64, device=device)
        # whether a step whose sampled rows are fewer than its tokens runs the last layer for
        # those rows only (OutputRows): a generating model's last stage, for at most
        # max_num_seqs rows (a decode batch's attention shapes, which the warm-up compiles)
        self._prunes = pooler is None and self.stage.is_last and isinstance(model,
                                                                             Qwen3ForCausalLM)
        self._max_out_rows = max_num_seqs
        self.sampler = Sampler()
        self._inference = torch.inference_mode()  # forward's; entered by one step at a time
        # the LM head's and the sampler's torch threads (workers/cpu_threads.py)
        self._head = head or ThreadScope(None)
        self.graph_runner: CUDAGraphRunner | None = None  # decode graphs
        # speculative verify graphs by query length (proposals + 1)
        self.verify_graph_runners: dict[int, CUDAGraphRunner] = {}

    @property
    def seqs(self) -> dict:
        """seq id -> SeqState of every sequence this worker holds."""
        return self.table.seqs

    @property
    def num_gpu_blocks(self) -> int:
        return self.table.num_gpu_blocks

    @num_gpu_blocks.setter
    def num_gpu_blocks(self, value: int) -> None:
        self.table.num_gpu_blocks = value

    # ---- host: the plan's inputs ----------------------------------------------------------

    def prepare(self, plan: StepPlan) -> StepBatch:
        """Apply the plan's state diffs and stage its inputs (plan order step 3 and the inputs
        of step 4). Pending tokens are checked here and gathered by `fill_pending`."""
        table, bs = self.table, self.block_size
        table.apply(plan)
        num_seqs, num_tokens = plan.num_seqs, plan.num_tokens
        rows = table.rows_of(plan.seq_ids)
        qlens = plan.query_lens.astype(np.int64)
        start = plan.start_pos.astype(np.int64)
        if qlens.shape != (num_seqs,) or start.shape != (num_seqs,) \
                or plan.do_sample.shape != (num_seqs,):
            raise ValueError("plan.query_lens, start_pos and do_sample must each have one entry "
                             f"per sequence ({num_seqs})")
        decode = num_tokens == num_seqs and int(qlens.max()) == 1  # one token each
        if decode:
            cu = None  # the device's arange
            positions, token_rows = start, rows
        else:
            if int(qlens.min()) < 1:
                raise ValueError(f"every scheduled sequence computes >= 1 token; "
                                 f"query_lens={qlens}")
            cu = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(qlens, out=cu[1:])
            if int(cu[-1]) != num_tokens:
                raise ValueError(f"plan.input_ids has {num_tokens} tokens; query_lens sum to "
                                 f"{int(cu[-1])}")
            positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(start - cu[:-1], qlens)
            token_rows = np.repeat(rows, qlens)
        seq_lens = start + qlens
        max_seq_len = int(seq_lens.max())
        if max_seq_len > self.max_model_len:
            raise ValueError(f"a sequence reaches {max_seq_len} tokens; "
                             f"max_model_len is {self.max_model_len}")
        short = seq_lens > table.num_blocks[rows] * bs  # (more blocks needed than held)
        if np.count_nonzero(short):
            i = int(np.argmax(short))
            n = int(seq_lens[i])
            raise ValueError(f"seq {int(plan.seq_ids[i])} needs {-(-n // bs)} blocks for {n} "
                             f"tokens; its block table has {int(table.num_blocks[rows[i]])}")
        slots = table.slots(token_rows, positions)
        input_ids = plan.input_ids
        pending = pending_src = None
        lowest = int(input_ids.min(initial=0))
        draft_at = None
        if lowest <= DRAFT_TOKEN and plan.num_draft_tokens is not None:
            draft_at = input_ids == DRAFT_TOKEN  # the draft model's proposals, filled on device
            input_ids = np.where(draft_at, 0, input_ids)
            lowest = int(input_ids.min(initial=0))
        if lowest < 0:
            pending = (input_ids < 0).nonzero()[0]
            if pending.shape[0] == num_tokens:  # (every token row: filled in place, no index)
                pending = None
            input_ids, pending_src = self.pending.resolve(plan, pending, token_rows, lowest)
        all_sample = np.count_nonzero(plan.do_sample) == num_seqs
        sample = None if all_sample else np.flatnonzero(plan.do_sample)
        sample_rows = rows if all_sample else rows[sample]
        num_sampled = num_seqs if all_sample else int(sample.shape[0])
        self.pending.record(plan.step_id, sample_rows)
        table.num_tokens[rows] = seq_lens
        features = int(np.bitwise_or.reduce(table.features[sample_rows])) if num_sampled else 0

        prompt = None
        if table.num_prompt_logprob_seqs:
            prompt = select_prompt_rows(table, plan.seq_ids, rows, start, qlens,
                                        np.arange(num_seqs) if cu is None else cu[:-1])
        # (a prompt chunk is never a graph step: graphs are for steps where every row samples)
        graphs = None if prompt is not None else self._graphs_for(plan, decode, qlens,
                                                                   num_sampled)
        graph = 0 if graphs is None else graphs.padded_size(num_seqs)
        pad = graph - num_seqs if graph else 0
        q = graphs.query_len if graph else 1
        tpad = pad * q  # padding token rows (and sampled rows: a graph step samples each)
        logits_idx = None
        if not all_sample or not decode:
            logits_idx = (cu[1:] - 1) if cu is not None else np.arange(num_seqs, dtype=np.int64)
            if not all_sample:
                logits_idx = logits_idx[sample]
        diff_rows, diff_cols, diff_ids = table.take_block_diff()
        s_seq_lens = seq_lens if all_sample else seq_lens[sample]
        s_counter = s_seq_lens - table.prompt_len[sample_rows]
        sampled_seq_ids = plan.seq_ids if all_sample else plan.seq_ids[sample]
        constrained = plan.constrained_rows
        spec = entries = None
        draft_in_graph = False
        if plan.num_draft_tokens is not None and num_sampled:
            drafts = plan.num_draft_tokens if all_sample else plan.num_draft_tokens[sample]
            if draft_at is not None and graph:
                # (a verify graph's rows: q tokens each, the last known one, then proposals)
                at = draft_at.reshape(num_seqs, q)
                draft_in_graph = bool(at[:, 1:].all()) and not at[:, 0].any()
            if draft_at is not None and not draft_in_graph:
                entries = draft_entries_for(drafts.astype(np.int64), logits_idx, sample_rows,
                                              positions, slots, draft_at)
                # rows of the draft's proposals beside rows of given ones: no graph's shape
                graphs, graph, pad, tpad, q = None, 0, 0, 0, 1
            sample_rows, logits_idx, s_counter, constrained, spec = verify_rows(
                drafts.astype(np.int64), sample_rows, logits_idx, s_counter, constrained,
                input_ids)
            num_sampled = int(sample_rows.shape[0])
        lora_on = self.lora is not None and bool((table.lora_slot[rows] >= 0).any())
        keep = None  # (LoRA's slots are per token row: a step with adapters keeps every row)
        if self._prunes and logits_idx is not None and not graph and prompt is None \
                and 0 < num_sampled < num_tokens and num_sampled <= self._max_out_rows \
                and not lora_on:
            keep = output_row_arrays(logits_idx, cu, positions, rows)
        s_temp = table.temperature[sample_rows]
        pen = NO_PENALTIES
        if table.penalties.num_used:  # (sequences with penalties are rare: skip it all)
            pen = penalty_arrays(table, sample_rows, token_rows, positions)
        # int64: the graph's inputs first, in cuda_graph.GRAPH_I64_FIELDS order, padded
        i64 = [padded(input_ids, tpad, 0), padded(positions, tpad, 0),
               padded(slots, tpad, -1), padded(table.rng_key[sample_rows], tpad, 0),
               padded(s_counter, tpad, 0), padded(rows, pad, 0), logits_idx, pending, pending_src,
               diff_rows if diff_rows.size else None, diff_cols if diff_rows.size else None,
               *pen[:4], *((None, None) if spec is None else (a.reshape(-1) for a in spec)),
               *((None, None) if prompt is None else (prompt.hidden_rows, prompt.targets)),
               *((None,) * 6 if entries is None else entries.i64),
               None if self.lora is None else lora_slots(table, token_rows, tpad,
                                                         self.lora.max_tokens),
               None if keep is None else keep[0]]
        i32 = [padded(seq_lens, pad, q), cu, table.top_k[sample_rows] if features & TOP_K
               else None, diff_ids if diff_ids.size else None,
               None if entries is None else entries.seq_lens, None if keep is None else keep[1]]
        f32 = [padded(s_temp, tpad, 0.0), table.top_p[sample_rows] if features & TOP_P else None,
               table.min_p[sample_rows] if features & MIN_P else None, *pen[4:]]
        (v64, v32, vf), regions = self.stager.stage(i64, i32, f32)
        (d_ids, d_pos, d_slots, d_key, d_counter, d_rows, d_logits_idx, d_pending,
         d_pending_src, d_diff_rows, d_diff_cols, d_pen_rows, d_pen_slots, d_pen_tokens,
         d_tok_slot, d_gather, d_proposal, d_prompt_rows, d_prompt_targets, *v_draft,
         d_lora, d_keep_rows) = v64
        if prompt is not None:
            prompt.d_hidden_rows, prompt.d_targets = d_prompt_rows, d_prompt_targets
        d_seq_lens, d_cu, d_top_k, d_diff_ids, d_draft_lens, d_keep_lens = v32
        d_temp, d_top_p, d_min_p, d_is_prompt, d_rep, d_freq, d_pres = vf
        if d_diff_ids is not None:
            table.device_block_table.index_put_((d_diff_rows, d_diff_cols), d_diff_ids)
        block_tables = None
        if not graph:
            width = (max_seq_len + bs - 1) // bs  # (the most blocks a sequence needs)
            if table.device_is_host:  # (CPU: one numpy gather, no torch op)
                block_tables = torch.from_numpy(table.block_table[:, :width].take(rows, 0))
            else:
                block_tables = table.device_block_table[:, :width].index_select(0, d_rows)
        md = AttentionMetadata(
            slot_mapping=d_slots, block_tables=block_tables,
            query_start_loc=self._one_token_cu_of(num_seqs) if d_cu is None else d_cu,
            seq_lens=d_seq_lens, max_query_len=1 if decode else int(qlens.max()),
            max_seq_len=max_seq_len)
        out_rows = None
        if keep is not None:
            out_rows = OutputRows(d_logits_idx, self._one_token_metadata(keep, d_keep_rows,
                                                                         d_keep_lens))
        sampling = None
        if num_sampled:
            # (without a graph's padding rows they hold num_sampled each: no torch slice)
            temp, key, counter = ((t[:num_sampled] for t in (d_temp, d_key, d_counter)) if tpad
                                  else (d_temp, d_key, d_counter))
            sampling = SamplingMetadata(
                temperature=temp, all_greedy=not features & RANDOM,
                top_k=d_top_k, top_p=d_top_p, min_p=d_min_p, rng_key=key,
                rng_counter=counter, penalties=None,  # (sample() fills them)
                max_num_logprobs=(int(table.num_logprobs[sample_rows].max())
                                  if features & LOGPROBS else None),
                max_top_k=max_top_k(table, sample_rows) if features & TOP_K else None)
        return StepBatch(
            step_id=plan.step_id, input_ids=d_ids, positions=d_pos, attn_metadata=md,
            logits_indices=d_logits_idx, sampling=sampling,
            simple=not (features & ~RANDOM or plan.num_constrained),
            graphs=graphs if graph else None, graph_size=graph,
            graph_i64=regions[0] if graph else None,
            graph_rows=d_rows if graph else None, graph_temperature=d_temp if graph else None,
            pending_pos=d_pending, pending_src=d_pending_src,
            penalty_tokens=None if d_pen_tokens is None else (d_pen_tokens, d_tok_slot,
                                                              d_is_prompt),
            penalty_rows=None if d_pen_rows is None else (d_pen_rows, d_pen_slots, d_rep, d_freq,
                                                          d_pres),
            sample_rows=sample_rows, sampled_seq_ids=sampled_seq_ids, rows=rows,
            constrained_rows=constrained,
            verify=None if spec is None else (d_gather.view(spec[0].shape),
                                               d_proposal.view(spec[1].shape)),
            draft=None if entries is None else DraftBatch(entries, *v_draft, d_draft_lens),
            draft_in_graph=draft_in_graph, prompt=prompt, lora_slots=d_lora,
            lora_active=lora_on, out_rows=out_rows)

    def _one_token_cu_of(self, n: int) -> Tensor:
        """query_start_loc of `n` one-token queries (views of one arange, kept by size)."""
        cu = self._one_token_cu.get(n)
        if cu is None:
            if n + 1 > self._arange.shape[0]:
                self._arange = torch.arange(2 * n + 1, dtype=torch.int32, device=self.device)
            cu = self._one_token_cu[n] = self._arange[:n + 1]
        return cu

    def _one_token_metadata(self, keep: tuple[np.ndarray, np.ndarray], d_rows: Tensor,
                            d_seq_lens: Tensor) -> AttentionMetadata:
        """`OutputRows`' metadata: `keep`'s (table rows, seq lens) as one-token queries,
        writing nothing (their K/V are stored by the step's own metadata)."""
        rows, seq_lens = keep
        top = int(seq_lens.max())
        width = -(-top // self.block_size)
        table = self.table
        if table.device_is_host:
            tables = torch.from_numpy(table.block_table[:, :width].take(rows, 0))
        else:
            tables = table.device_block_table[:, :width].index_select(0, d_rows)
        return AttentionMetadata(slot_mapping=self._no_slots, block_tables=tables,
                                 query_start_loc=self._one_token_cu_of(rows.shape[0]),
                                 seq_lens=d_seq_lens, max_query_len=1, max_seq_len=top)

    def _graphs_for(self, plan: StepPlan, decode: bool, qlens: np.ndarray,
                    num_sampled: int) -> CUDAGraphRunner | None:
        """The runner whose graphs fit the step, if any: every sequence samples, and either
        each computes one token (decode) or each is a verify row of the same d proposals
        (workers/cuda_graph.py says which d have graphs)."""
        if num_sampled != plan.num_seqs:
            return None
        if decode:
            return self.graph_runner
        q = int(qlens[0])
        g = self.verify_graph_runners.get(q)
        if g is None or plan.num_draft_tokens is None:
            return None
        if not (qlens == q).all() or not (plan.num_draft_tokens == q - 1).all():
            return None
        return g

    # ---- device: forward, logits, sampling ------------------------------------------------

    def fill_pending(self, batch: StepBatch, tp: TensorParallelGroup | OutputBroadcast) -> None:
        """Gather the step's pending tokens on the device (workers/pending.py)."""
        if batch.pending_src is not None:
            self.pending.fill(batch.input_ids, batch.pending_pos, batch.pending_src, tp)

    def forward(self, batch: StepBatch, keep_logits: bool = False
                ) -> tuple[Tensor | None, Tensor | None]:
        """(logits `[S, vocab]` of the sampled rows, or None; tokens sampled inside a CUDA graph
        or, plain greedy rows without `keep_logits`, over the vocabulary shards, or None: the
        sampler must still run). Ranks > 0: (None, None). Prompt logprobs: `batch.prompt_out`."""
        with self._inference:  # (made once: the decorator makes a context per call)
            return self._forward(batch, keep_logits)

    def _forward(self, batch: StepBatch, keep_logits: bool
                 ) -> tuple[Tensor | None, Tensor | None]:
        if batch.penalty_tokens is not None:
            rows, slots, is_prompt = batch.penalty_tokens
            self.table.penalties.record(slots, batch.input_ids[rows], is_prompt)
        if batch.lora_slots is not None:
            lora = self.lora.batch
            lora.token_slots[:batch.lora_slots.shape[0]].copy_(batch.lora_slots)
            lora.active = batch.lora_active
        if batch.graphs is not None:
            logits, tokens = batch.graphs.replay(batch, self.table.device_block_table)
            n = batch.num_sampled
            if logits is None:
                return None, None
            return logits[:n], tokens[:n] if batch.simple else None
        hidden = self.stage.forward(self.model, batch.input_ids, batch.positions,
                                    batch.attn_metadata, batch.out_rows)
        if hidden is None:  # a pipeline stage before the last: its output went on
            return None, None
        if self.pooler is not None:
            batch.pooled = self.pooler.pool(self.model, hidden, batch.attn_metadata,
                                            batch.positions, batch.rows, batch.logits_indices,
                                            batch.sample_rows)
            return None, None
        if batch.prompt is not None:
            batch.prompt_out = compute_prompt_logprobs(self.model, hidden, batch.prompt)
        if batch.sampling is None:
            return None, None
        if batch.logits_indices is not None and batch.out_rows is None:
            hidden = hidden[batch.logits_indices]  # (None: every row samples, one token each)
        with self._head(hidden.shape[0]):
            if batch.simple and batch.sampling.all_greedy and not keep_logits:
                return None, self.model.lm_head.greedy_tokens(hidden)  # (no logits sent)
            return self.model.compute_logits(hidden), None

    def follow(self, batch: StepBatch, drafter: DraftRunner) -> None:
        """The draft's K/V for every token of the step (workers/draft_runner.py's invariant):
        a graph step replays its captured follow graph over the graph's own inputs."""
        if batch.graphs is not None:
            batch.graphs.replay_follow(batch.graph_size)
        else:
            drafter.follow(batch.input_ids, batch.positions, batch.attn_metadata)

    def bitmask_for(self, batch: StepBatch, bitmask: np.ndarray) -> Tensor:
        """The step's token bitmask on the device: all ones but on the constrained rows."""
        rows = batch.constrained_rows
        words = -(-self.vocab_size // 32)
        if bitmask.shape != (rows.shape[0], words) or bitmask.dtype != np.int32:
            raise ValueError(f"the bitmask must be int32 [{rows.shape[0]}, {words}]; "
                             f"got {bitmask.dtype} {list(bitmask.shape)}")
        (i64, i32, _), _ = self.bitmask_stager.stage([rows], [bitmask.reshape(-1)], [])
        full = torch.full((batch.num_sampled, words), -1, dtype=torch.int32, device=self.device)
        return full.index_copy_(0, i64[0], i32[0].view(-1, words))

    def sample(self, batch: StepBatch, logits: Tensor,
               token_bitmask: Tensor | None = None) -> SamplerOutput:
        md = batch.sampling
        assert md is not None
        md.token_bitmask = token_bitmask
        if batch.penalty_rows is not None:  # counted up to this step's inputs (forward())
            rows, slots, rep, freq, pres = batch.penalty_rows
            state = self.table.penalties
            md.penalties = PenaltyInputs(
                rows=rows, output_counts=state.output_counts.index_select(0, slots),
                prompt_mask=state.prompt_counts.index_select(0, slots) > 0,
                repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                logit_bias=state.logit_bias.index_select(0, slots))
        with self._head(logits.shape[0]):
            return self.sampler(logits, md)

