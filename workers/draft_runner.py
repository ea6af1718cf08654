"""Speculative decoding's draft model on a worker: loading it, its proposals, its KV cache.

The draft (`speculative_config: {model: dir, num_speculative_tokens: k}`) is a small Qwen3
of the target's vocabulary (Qwen3-0.6B for Qwen3-8B; `qwen3-tiny-draft` on CPU). It runs in
the target's worker processes, sharded over the same tensor-parallel group as the target
(its own all-reduces and logits gather on the target's group). Sharded rather than
replicated because (1) its KV heads then split over the ranks exactly as the target's do, so
its per-rank KV layout is the target's (`check_draft_fits`) and its layers join the target's
in the one stacked cache tensor of `CacheEngine`: swap, copy-on-write and the offload tier
copy a block of both models in the same copy, with no second allocator and no second copy
path; (2) a replicated draft would hold its whole KV and weights on every rank (tp times the
memory) and still need its proposals broadcast or computed identically on every rank.
The cost is the draft's collectives (two all-reduces per layer), small next to the target's.

KV cache: the draft's layers are indexed by the SAME block ids, block tables and slot mapping
as the target's (the scheduler's blocks hold both models' K/V; `kv_block_bytes` counts both).
Invariant: every position whose target K/V is in a block also has the draft's K/V there,
computed from the same token: `follow` runs the draft over every step's whole batch (prefill
chunks, decodes, verify rows) after the target's inputs are known, so prefix-cache hits,
recompute after preemption and swapped blocks carry valid draft K/V too. Rejected proposals'
slots are overwritten later, exactly as the target's.

Proposals (`propose`): a verify row whose proposals are `DRAFT_TOKEN` holds the sequence's
last token at position p and d placeholders. Before the target's forward, the draft decodes
d tokens greedily, one batched forward per proposal index j over the rows with d > j (input:
the row's token at p + j, i.e. its last token, then its own proposal j - 1; K/V written at
the row's slot for p + j, reserved by the verify row), and its argmax goes into the
placeholder at p + j + 1 and into the rejection sampler's proposal matrix, on the device.
Greedy makes the proposal a point mass, which `workers/rejection_sampler.py` accepts exactly.
With tp > 1 rank 0 holds the gathered logits and broadcasts each forward's tokens (one small
collective per proposal index). The host only builds index arrays from the plan (numpy, no
per-request loop); no device value is read on the host.

CUDA graphs (workers/cuda_graph.py): on a step that replays a decode or verify graph, `follow`
is the graph's captured twin (the draft's forward over the graph's static inputs and block
tables, padding rows included: they write no K/V), and a verify graph's proposals come from
its captured `propose_uniform` (the same forwards as `propose` for a batch of equal rows,
indexed by the regular layout instead of host-made entries).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from workers.distributed import TensorParallelGroup
from workers.layers.attention import Attention, AttentionMetadata
from workers.loader import load_model
from workers.model_config import ModelConfig, load_model_config
from workers.qwen3 import Qwen3ForCausalLM


def check_draft_fits(target: ModelConfig, draft: ModelConfig, tensor_parallel_size: int) -> None:
    """ValueError unless `draft` can propose for `target`: the same vocabulary size and the
    same per-rank KV layout (its layers share the target's cache tensor and block ids)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model {draft.model} has vocab_size "
                         f"{draft.vocab_size}, the target {target.model} {target.vocab_size}; "
                         "a draft must share the target's vocabulary (e.g. Qwen3-0.6B for Qwen3-8B)")
    tp = tensor_parallel_size
    got = (draft.num_kv_heads_per_rank(tp), draft.head_dim)
    want = (target.num_kv_heads_per_rank(tp), target.head_dim)
    if got != want:
        raise ValueError(f"speculative_config.model {draft.model} has {got[0]} KV heads per rank "
                         f"of dim {got[1]} at tensor_parallel_size {tp}; the target has "
                         f"{want[0]} of dim {want[1]}. The draft's KV shares the target's cache "
                         "blocks, so its KV layout must match (every dense Qwen3 has 8 KV heads of "
                         "dim 128)")


@dataclass(slots=True)
class DraftEntries:
    """One step's draft forwards, built on the host from the plan: entries (row, j) in
    j-major order; forward j is entries offsets[j]:offsets[j+1]."""

    offsets: list[int]
    max_seq_lens: list[int]  # per forward
    rows: np.ndarray  # int64 [E] table rows (host, for CPU block tables)
    i64: list[np.ndarray]  # positions, slots, table rows, src, fill, prop (see draft_entries)
    seq_lens: np.ndarray  # int32 [E]


def draft_entries(drafts: np.ndarray, first: np.ndarray, rows: np.ndarray,
                  positions: np.ndarray, slots: np.ndarray, width: int) -> DraftEntries:
    """The entries of sampled rows with `drafts[i]` DRAFT_TOKEN proposals (0: none):
    `first[i]` is the row's first token index in the batch (its last known token), `rows[i]`
    its table row, `width` the proposal matrix's columns. Per entry (row i, index j): its
    position and slot (those of token first[i] + j), src (forward 0: the batch token
    first[i]; later: the entry (i, j - 1)), fill (the batch token first[i] + j + 1 its
    output replaces) and prop (i * width + j in the proposal matrix)."""
    counts = drafts.astype(np.int64)
    total = int(counts.sum())
    starts = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    row_of = np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)  # row-major
    j = np.arange(total, dtype=np.int64) - starts[row_of]
    order = np.argsort(j, kind="stable")  # j-major, rows in batch order within each j
    where = np.empty(total, dtype=np.int64)
    where[order] = np.arange(total, dtype=np.int64)  # row-major index -> j-major index
    row_of, j = row_of[order], j[order]
    tok = first[row_of] + j
    src = np.where(j == 0, first[row_of], where[np.maximum(order - 1, 0)])
    pos = positions[tok]
    seq_lens = (pos + 1).astype(np.int32)
    offsets = np.searchsorted(j, np.arange(int(counts.max()) + 1)).tolist()
    max_lens = np.maximum.reduceat(seq_lens, offsets[:-1]).tolist()
    table_rows = rows[row_of]
    return DraftEntries(offsets, max_lens, table_rows,
                        [pos, slots[tok], table_rows, src, tok + 1, row_of * width + j], seq_lens)


@dataclass(slots=True)
class DraftBatch:
    """DraftEntries on the device (staged with the step's inputs)."""

    entries: DraftEntries
    positions: Tensor
    slots: Tensor
    rows: Tensor
    src: Tensor
    fill: Tensor
    prop: Tensor
    seq_lens: Tensor


class DraftRunner:
    """The draft model's forwards on one rank (see the module docstring)."""

    def __init__(self, model: Qwen3ForCausalLM, model_config: ModelConfig, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self._arange = torch.arange(1, dtype=torch.int32, device=device)
        self._tokens = torch.zeros(0, dtype=torch.int64, device=device)

    @classmethod
    def load(cls, path: str, target: ModelConfig, tp: TensorParallelGroup, dtype: torch.dtype,
             backend: str, max_model_len: int, block_size: int,
             device: torch.device) -> DraftRunner:
        """Build this rank's shard of the draft at `path` and load its weights."""
        mc = load_model_config(path, tp.world_size)
        check_draft_fits(target, mc, tp.world_size)
        mc.check_max_model_len(max_model_len)
        with torch.device(device):
            model = Qwen3ForCausalLM(mc, tp, dtype, backend, max_position=max_model_len)
        load_model(model, path)
        model.eval()
        return cls(model, mc, block_size, device)

    def attention_layers(self) -> list[Attention]:
        return self.model.attention_layers()

    def kv_block_bytes(self, tensor_parallel_size: int, itemsize: int) -> int:
        return self.model_config.kv_block_bytes(self.block_size, tensor_parallel_size, itemsize)

    @torch.inference_mode()
    def propose(self, input_ids: Tensor, proposal: Tensor, batch: DraftBatch,
                host_table: np.ndarray, device_table: Tensor | None,
                tp: TensorParallelGroup) -> None:
        """Fill the step's DRAFT_TOKEN inputs and their columns of the rejection sampler's
        proposal matrix with the draft's greedy tokens (on the device)."""
        e = batch.entries
        total = e.offsets[-1]
        if self._tokens.shape[0] < total:
            self._tokens = torch.zeros(2 * total, dtype=torch.int64, device=self.device)
        tokens = self._tokens[:total]
        largest = max(b - a for a, b in zip(e.offsets, e.offsets[1:]))
        if self._arange.shape[0] < largest + 1:
            self._arange = torch.arange(2 * largest + 1, dtype=torch.int32, device=self.device)
        bs = self.block_size
        for j, (a, b) in enumerate(zip(e.offsets, e.offsets[1:])):
            width = -(-e.max_seq_lens[j] // bs)
            if device_table is None:  # (CPU: the host table is the device table)
                tables = torch.from_numpy(host_table[e.rows[a:b], :width])
            else:
                tables = device_table[:, :width].index_select(0, batch.rows[a:b])
            md = AttentionMetadata(
                slot_mapping=batch.slots[a:b], block_tables=tables,
                query_start_loc=self._arange[:b - a + 1], seq_lens=batch.seq_lens[a:b],
                max_query_len=1, max_seq_len=e.max_seq_lens[j])
            ids = (input_ids if j == 0 else tokens).index_select(0, batch.src[a:b])
            self._greedy(ids, batch.positions[a:b], md, tokens[a:b], tp)
        input_ids.index_put_((batch.fill,), tokens)
        proposal.view(-1).index_put_((batch.prop,), tokens)

    def _greedy(self, ids: Tensor, positions: Tensor, md: AttentionMetadata, out: Tensor,
                tp: TensorParallelGroup) -> None:
        """One draft forward of one token per row: its argmax into `out` on every rank."""
        logits = self.model.compute_logits(self.model(ids, positions, md))
        if logits is not None:  # rank 0
            torch.argmax(logits, dim=-1, out=out)
        tp.broadcast_from_first(out)

    def propose_uniform(self, input_ids: Tensor, positions: Tensor, md: AttentionMetadata,
                        proposal: Tensor, tp: TensorParallelGroup) -> None:
        """`propose` for a batch whose every row is a verify row of q - 1 DRAFT_TOKENs, from
        its step's metadata (rows of q tokens, query_start_loc i * q): the same forwards over
        every row at once, with no host-made index (what a verify CUDA graph captures).
        `proposal` [B, q] gets the tokens in its first q - 1 columns."""
        bs, q = proposal.shape
        ids, pos = input_ids.view(bs, q), positions.view(bs, q)
        slots = md.slot_mapping.view(bs, q)
        starts = md.query_start_loc[:bs + 1] // q  # 0..bs: one token per row
        for j in range(q - 1):
            step = AttentionMetadata(
                slot_mapping=slots[:, j].contiguous(), block_tables=md.block_tables,
                query_start_loc=starts, seq_lens=md.seq_lens - (q - 1 - j), max_query_len=1,
                max_seq_len=md.max_seq_len)
            out = torch.empty(bs, dtype=torch.int64, device=input_ids.device)
            self._greedy(ids[:, j].contiguous(), pos[:, j].contiguous(), step, out, tp)
            ids[:, j + 1] = out
            proposal[:, j] = out

    @torch.inference_mode()
    def follow(self, input_ids: Tensor, positions: Tensor, md: AttentionMetadata) -> None:
        """The draft's K/V for every token of the step's batch (the invariant above); no
        logits."""
        self.model(input_ids, positions, md)
