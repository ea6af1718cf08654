"""CUDA graphs for decode batches (one token per sequence), captured once after KV allocation.

One graph per padded batch size in `capture_batch_sizes(max_num_seqs)` (1, 2, 4, 8, then
every multiple of 16, then max_num_seqs itself), all sharing one memory pool and one set of
static input buffers sized for the largest. A batch of B sequences replays the smallest
graph of size >= B; rows past B are padding: slot -1 (no KV write), seq_len 1 over block 0
(a finite read of a zero-initialised cache), and their outputs are ignored.
Attention is captured with max_seq_len = max_model_len so one graph serves every context
length (the kernels read the true lengths from `seq_lens`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from workers.layers.attention import AttentionMetadata
from workers.qwen3 import Qwen3ForCausalLM


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes covering every B in [1, max_num_seqs]."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class CUDAGraphRunner:
    """Captured decode forwards over static buffers; `run` copies a batch in and replays."""

    def __init__(self, model: Qwen3ForCausalLM, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        n = max_num_seqs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        self.hidden_size = hidden_size

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            query_start_loc=self.query_start_loc[:bs + 1], seq_lens=self.seq_lens[:bs],
            max_query_len=1, max_seq_len=self.max_model_len)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first so smaller graphs reuse its pool."""
        pool = None
        for bs in reversed(self.batch_sizes):
            md = self._metadata(bs)
            # Warm-up outside capture: Triton compiles and autotunes here, not inside the graph.
            self.model(self.input_ids[:bs], self.positions[:bs], md)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(self.input_ids[:bs], self.positions[:bs], md)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def can_run(self, num_seqs: int, max_query_len: int) -> bool:
        return max_query_len == 1 and 0 < num_seqs <= self.batch_sizes[-1] and bool(self.graphs)

    def run(self, input_ids: Tensor, positions: Tensor, md: AttentionMetadata) -> Tensor:
        """Hidden states `[B, hidden]` of a pure-decode batch of B sequences."""
        b = input_ids.shape[0]
        bs = next(s for s in self.batch_sizes if s >= b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(md.slot_mapping)
        self.seq_lens[:b].copy_(md.seq_lens)
        nb = md.block_tables.shape[1]
        self.block_tables[:b, :nb].copy_(md.block_tables)
        if bs > b:
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.slot_mapping[b:bs].fill_(-1)
            self.seq_lens[b:bs].fill_(1)
            self.block_tables[b:bs, 0].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
