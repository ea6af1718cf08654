"""CUDA graphs for decode batches (one token per sequence), captured once after KV allocation.

One graph per padded batch size in `capture_batch_sizes(max_num_seqs)` (1, 2, 4, 8, then
every multiple of 16, then max_num_seqs itself), all sharing one memory pool. A graph holds
the forward, the logits and (rank 0) greedy/temperature sampling (`workers.sampler.sample_simple`)
over its own static inputs; a batch of B sequences replays the smallest graph of size >= B.
Rows past B are padding: slot -1 (no KV write), seq_len 1 over the block table of row 0 (a
finite read), temperature 0; their outputs are ignored. Attention is captured with
max_seq_len = max_model_len so one graph serves every context length (the kernels read the
true lengths from `seq_lens`).

Static inputs are laid out as the model runner stages them: the int64 ones back to back in
`GRAPH_I64_FIELDS` order, so a step hands them over with one device copy (plus seq_lens,
temperature and a gather of the block-table rows). `graph_factory` makes the graphs: CUDA
graphs on a GPU; `EagerGraph` replays the captured function eagerly, which lets CPU tests run
every line of the hand-over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from workers.layers.attention import AttentionMetadata
from workers.qwen3 import Qwen3ForCausalLM
from workers.sampler import sample_simple

# The staged int64 inputs of a graph step, in order, each padded to the graph's size.
GRAPH_I64_FIELDS = ("input_ids", "positions", "slot_mapping", "rng_key", "rng_counter")


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes covering every B in [1, max_num_seqs]."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class CUDAGraphFactory:
    """Makes CUDA graphs that share one memory pool (the first graph captured creates it)."""

    def __init__(self) -> None:
        self.pool: Any = None

    def __call__(self) -> _CUDAGraph:
        return _CUDAGraph(self)


class _CUDAGraph:
    def __init__(self, factory: CUDAGraphFactory) -> None:
        self.factory = factory
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], Any]) -> Any:
        with torch.cuda.graph(self.graph, pool=self.factory.pool):
            out = fn()
        if self.factory.pool is None:
            self.factory.pool = self.graph.pool()
        return out

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """Stands in for a CUDA graph where there is none: replay runs the function again and
    writes its results into the tensors capture returned (as a graph's outputs are)."""

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.fn = fn
        self.outputs = fn()
        return self.outputs

    def replay(self) -> None:
        for static, fresh in zip(self.outputs, self.fn()):
            if static is not None:
                static.copy_(fresh)


class _DecodeGraph:
    """Static inputs, outputs and the graph of one padded batch size."""

    def __init__(self, bs: int, max_blocks: int, device: torch.device) -> None:
        self.i64 = torch.zeros(len(GRAPH_I64_FIELDS) * bs, dtype=torch.int64, device=device)
        (self.input_ids, self.positions, self.slot_mapping, self.rng_key,
         self.rng_counter) = self.i64.split(bs)
        self.slot_mapping.fill_(-1)
        self.seq_lens = torch.ones(bs, dtype=torch.int32, device=device)
        self.temperature = torch.zeros(bs, dtype=torch.float32, device=device)
        self.block_tables = torch.zeros(bs, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(bs + 1, dtype=torch.int32, device=device)
        self.logits: Tensor | None = None
        self.tokens: Tensor | None = None
        self.graph: Any = None


class CUDAGraphRunner:
    """Captured decode steps over static buffers; `replay` hands a staged batch in."""

    def __init__(self, model: Qwen3ForCausalLM, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int, device: torch.device,
                 graph_factory: Callable[[], Any] | None = None) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.graph_factory = graph_factory or CUDAGraphFactory()
        self.graphs: dict[int, _DecodeGraph] = {}

    def _metadata(self, g: _DecodeGraph) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=g.slot_mapping, block_tables=g.block_tables,
            query_start_loc=g.query_start_loc, seq_lens=g.seq_lens, max_query_len=1,
            max_seq_len=self.max_model_len)

    def _step(self, g: _DecodeGraph) -> tuple[Tensor | None, Tensor | None]:
        hidden = self.model(g.input_ids, g.positions, self._metadata(g))
        logits = self.model.compute_logits(hidden)
        if logits is None:  # ranks > 0
            return None, None
        return logits, sample_simple(logits, g.temperature, g.rng_key, g.rng_counter)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first so smaller graphs reuse its pool."""
        cuda = self.device.type == "cuda"
        for bs in reversed(self.batch_sizes):
            g = _DecodeGraph(bs, self.max_blocks, self.device)
            # Warm-up outside capture: Triton compiles and autotunes here, not inside the graph.
            self._step(g)
            if cuda:
                torch.cuda.synchronize()
            g.graph = self.graph_factory()
            g.logits, g.tokens = g.graph.capture(lambda g=g: self._step(g))
            if cuda:
                torch.cuda.synchronize()
            self.graphs[bs] = g

    def padded_size(self, num_seqs: int) -> int:
        """The graph size a decode batch of `num_seqs` replays; 0 when none fits."""
        if not self.graphs or num_seqs > self.batch_sizes[-1]:
            return 0
        return next(s for s in self.batch_sizes if s >= num_seqs)

    def replay(self, batch: Any, device_block_table: Tensor
               ) -> tuple[Tensor | None, Tensor | None]:
        """Run a staged decode step (a model_runner.StepBatch with `graph_size` set): its
        inputs into the graph's, then the graph; (logits [bs, V], tokens [bs]) on rank 0."""
        g = self.graphs[batch.graph_size]
        g.i64.copy_(batch.graph_i64[:g.i64.shape[0]])
        g.seq_lens.copy_(batch.attn_metadata.seq_lens)
        if batch.graph_temperature is not None:
            g.temperature.copy_(batch.graph_temperature)
        torch.index_select(device_block_table, 0, batch.graph_rows, out=g.block_tables)
        g.graph.replay()
        return g.logits, g.tokens
