"""CUDA graphs for decode and verify steps, captured once after KV allocation.

A `CUDAGraphRunner` captures steps of q tokens per sequence: q = 1 for decode batches, q = d + 1
for speculative decoding's verify batches (every sequence a verify row with d proposals). One
graph per padded batch size in `capture_batch_sizes` (1, 2, 4, 8, then every multiple of 16,
then the largest: max_num_seqs for decode; for verify with the configured k the batch size above
which the per-batch off switch stops speculation, so no verify graph is captured that no step
could replay), all graphs of every runner sharing one memory pool. A graph holds
the forward, the logits and (rank 0) greedy/temperature sampling
(`workers.sampler.sample_simple`) of every token row over its own static inputs; a batch of B
sequences replays the smallest graph of size >= B. Rows past B are padding: slot -1 (no KV
write), seq_len q over the block table of row 0 (a finite read: row 0 holds >= q tokens),
temperature 0; their outputs are ignored. Attention is captured with max_seq_len =
max_model_len and query_start_loc = i * q, so one graph serves every context length (the
kernels read the true lengths from `seq_lens`).

Fewer proposals than k (lookahead clipped by max_tokens or max_model_len near a request's end;
an n-gram match near the tail) have graphs of one sequence only (q in 2..k, batch size 1):
every verify step of a lone sequence (one conversation: where speculation pays most) replays a
graph, while
capturing every q at every batch size would multiply the graphs, and the logits each keeps
(bs * q * vocab), by k. Larger batches whose rows differ in proposals (or that mix prefill
chunks with verify rows) run eager.
The acceptance count (workers/rejection_sampler.py: a few small batched ops, no host sync) runs
after the graph, on the device, the same code for graph and eager steps.

With a speculative draft model each graph has a second one, `follow`: the draft's forward
over the same static inputs (its K/V for every token of the step), replayed after the step's
sampled ids' copy is enqueued, so that copy never waits for it; and each verify graph a third,
`propose`, replayed before it when the rows' proposals are the draft's (DRAFT_TOKEN): the
draft's q - 1 one-token forwards over every row (`DraftRunner.propose_uniform`), writing each
argmax into the next token's input and into the graph's proposal matrix, which the
acceptance count then reads.

Pipeline stages (workers/pipeline.py) capture their own part of the step: the first stage
from input ids to the (hidden states, residual) it sends, a middle stage from received ones to
sent ones, the last stage from received ones through the final norm, the logits and the
sampling; a single stage is first and last at once (the whole step, no hand-over). The
send/recv stays outside the graph: a stage after the first receives into its graph's static
`received` buffers before the replay, a stage before the last sends its graph's static `sent`
outputs after it, every row of the padded batch (each stage pads a plan alike: the same
captured sizes, the same plan), so a replay and its hand-over allocate nothing. Draft models
are whole-model only (refused at pp > 1: workers/config.py), so `follow` and `propose` are
captured on a single stage only.

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

from workers.distributed import TensorParallelGroup
from workers.draft_runner import DraftRunner
from workers.layers.attention import AttentionMetadata
from workers.pipeline import PipelineStage
from workers.qwen3 import Qwen3ForCausalLM
from workers.sampler import sample_simple

# The staged int64 inputs of a graph step, in order, each padded to the graph's token rows.
GRAPH_I64_FIELDS = ("input_ids", "positions", "slot_mapping", "rng_key", "rng_counter")


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes covering every B in [1, max_num_seqs]."""
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


class _StepGraph:
    """Static inputs, outputs and the graphs of one padded batch size (bs sequences of q
    tokens each: T = bs * q token rows)."""

    def __init__(self, bs: int, q: int, max_blocks: int, device: torch.device,
                 received: tuple[int, torch.dtype] | None = None) -> None:
        t = bs * q
        self.i64 = torch.zeros(len(GRAPH_I64_FIELDS) * t, dtype=torch.int64, device=device)
        (self.input_ids, self.positions, self.slot_mapping, self.rng_key,
         self.rng_counter) = self.i64.split(t)
        self.slot_mapping.fill_(-1)
        # (padding rows: q tokens at positions 0..q-1 of row 0's blocks, a finite read)
        self.seq_lens = torch.full((bs,), q, dtype=torch.int32, device=device)
        self.temperature = torch.zeros(t, dtype=torch.float32, device=device)
        self.block_tables = torch.zeros(bs, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, t + 1, q, dtype=torch.int32, device=device)
        # a stage after the first: the previous stage's (hidden states, residual) land here
        self.received: tuple[Tensor, Tensor] | None = None
        if received is not None:
            hidden_size, dtype = received
            self.received = tuple(torch.zeros(t, hidden_size, dtype=dtype, device=device)
                                  for _ in range(2))
        # a stage before the last: the graph's (hidden states, residual), sent on after replay
        self.sent: tuple[Tensor, Tensor] | None = None
        self.logits: Tensor | None = None  # the last stage's
        self.tokens: Tensor | None = None
        self.graph: Any = None
        self.follow: Any = None  # the draft's forward over the same inputs (or None)
        self.propose: Any = None  # verify graphs with a draft: its proposals (or None)
        # the rejection sampler's proposals (-1 in the last column: never agrees)
        self.proposal = torch.full((bs, q), -1, dtype=torch.int64, device=device)


class CUDAGraphRunner:
    """Captured steps of `query_len` tokens per sequence over static buffers; `replay` hands a
    staged batch in, `replay_follow` then runs the draft's captured forward over it."""

    def __init__(self, model: Qwen3ForCausalLM, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int, device: torch.device,
                 graph_factory: Callable[[], Any] | None = None, query_len: int = 1,
                 drafter: DraftRunner | None = None,
                 tp: TensorParallelGroup | None = None,
                 stage: PipelineStage | None = None) -> None:
        self.model = model
        self.drafter = drafter
        self.tp = tp or TensorParallelGroup.single()
        self.stage = stage or PipelineStage.single()
        self.query_len = query_len
        self.max_model_len = max_model_len
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.graph_factory = graph_factory or CUDAGraphFactory()
        self.graphs: dict[int, _StepGraph] = {}

    def _metadata(self, g: _StepGraph) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=g.slot_mapping, block_tables=g.block_tables,
            query_start_loc=g.query_start_loc, seq_lens=g.seq_lens,
            max_query_len=self.query_len, max_seq_len=self.max_model_len)

    def _step(self, g: _StepGraph) -> tuple[Tensor | None, Tensor | None]:
        """This stage's part of the step: (logits, tokens) on the last stage (None, None on
        its ranks > 0), the (hidden states, residual) to send on before it."""
        hidden = self.model(g.input_ids, g.positions, self._metadata(g), g.received)
        if not self.stage.is_last:
            return hidden
        logits = self.model.compute_logits(hidden)
        if logits is None:  # ranks > 0
            return None, None
        return logits, sample_simple(logits, g.temperature, g.rng_key, g.rng_counter)

    def _follow(self, g: _StepGraph) -> tuple[()]:
        assert self.drafter is not None
        self.drafter.model(g.input_ids, g.positions, self._metadata(g))
        return ()

    def _propose(self, g: _StepGraph) -> tuple[()]:
        assert self.drafter is not None
        self.drafter.propose_uniform(g.input_ids, g.positions, self._metadata(g), g.proposal,
                                     self.tp)
        return ()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first so smaller graphs reuse its pool."""
        received = None if self.stage.is_first else (self.model.config.hidden_size,
                                                      self.model.dtype)
        for bs in reversed(self.batch_sizes):
            g = _StepGraph(bs, self.query_len, self.max_blocks, self.device, received)
            if self.drafter is not None and self.query_len > 1:
                g.propose, _ = self._capture(lambda g=g: self._propose(g))
            g.graph, out = self._capture(lambda g=g: self._step(g))
            if self.stage.is_last:
                g.logits, g.tokens = out
            else:
                g.sent = out
            if self.drafter is not None:
                g.follow, _ = self._capture(lambda g=g: self._follow(g))
            self.graphs[bs] = g

    def _capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        cuda = self.device.type == "cuda"
        # Warm-up outside capture: Triton compiles and autotunes here, not inside the graph.
        fn()
        if cuda:
            torch.cuda.synchronize()
        graph = self.graph_factory()
        out = graph.capture(fn)
        if cuda:
            torch.cuda.synchronize()
        return graph, out

    @property
    def max_tokens(self) -> int:
        """Token rows of the largest graph."""
        return self.batch_sizes[-1] * self.query_len

    def padded_size(self, num_seqs: int) -> int:
        """The graph size a batch of `num_seqs` replays; 0 when none fits."""
        if not self.graphs or num_seqs > self.batch_sizes[-1]:
            return 0
        return next(s for s in self.batch_sizes if s >= num_seqs)

    def replay(self, batch: Any, device_block_table: Tensor
               ) -> tuple[Tensor | None, Tensor | None]:
        """Run a staged step (a model_runner.StepBatch with `graph_size` set): its inputs
        into the graph's, the draft's proposals when its rows wait for them
        (`batch.draft_in_graph`: then `batch.verify` takes the graph's proposal matrix), then
        the graph; (logits [bs * q, V], tokens [bs * q]) on the output rank. A pipeline
        stage receives into the graph's inputs first, or sends its outputs on after it (then
        (None, None))."""
        g = self.graphs[batch.graph_size]
        g.i64.copy_(batch.graph_i64[:g.i64.shape[0]])
        g.seq_lens.copy_(batch.attn_metadata.seq_lens)
        if batch.graph_temperature is not None:
            g.temperature.copy_(batch.graph_temperature)
        torch.index_select(device_block_table, 0, batch.graph_rows, out=g.block_tables)
        if batch.draft_in_graph:
            g.propose.replay()
            n = batch.verify[0].shape[0]
            batch.verify = (batch.verify[0], g.proposal[:n])
        if g.received is not None:
            self.stage.recv_into(*g.received)
        g.graph.replay()
        if g.sent is not None:
            self.stage.send(*g.sent)
            return None, None
        return g.logits, g.tokens

    def replay_follow(self, graph_size: int) -> None:
        """The draft's forward over the inputs the last `replay` of this size handed in (its
        K/V for every token of the step: workers/draft_runner.py's invariant)."""
        self.graphs[graph_size].follow.replay()


def capture_step_graphs(model: Qwen3ForCausalLM, drafter: DraftRunner | None,
                        tp: TensorParallelGroup, max_num_seqs: int, max_blocks_per_seq: int,
                        max_model_len: int, device: torch.device, num_speculative_tokens: int = 0,
                        max_verify_seqs: int = 0, graph_factory: Callable[[], Any] | None = None,
                        stage: PipelineStage | None = None
                        ) -> tuple[CUDAGraphRunner, dict[int, CUDAGraphRunner]]:
    """The decode graphs and, with speculation (k = num_speculative_tokens > 0), the verify
    graphs by query length q: q = k + 1 up to `max_verify_seqs` sequences, q in 2..k for one
    sequence. All in one memory pool, the runner with the most token rows first; each with
    the draft's follow graphs (and, verify graphs, its propose graphs) when there is one;
    `stage`'s part of each step at pp > 1."""
    factory = graph_factory or CUDAGraphFactory()

    def runner(num_seqs: int, q: int) -> CUDAGraphRunner:
        return CUDAGraphRunner(model, num_seqs, max_blocks_per_seq, max_model_len, device,
                               factory, q, drafter, tp, stage)

    decode = runner(max_num_seqs, 1)
    verify: dict[int, CUDAGraphRunner] = {}
    k = num_speculative_tokens
    if k > 0 and max_verify_seqs > 0:
        verify = {q: runner(1, q) for q in range(2, k + 1)}
        verify[k + 1] = runner(min(max_num_seqs, max_verify_seqs), k + 1)
    for r in sorted([decode, *verify.values()], key=lambda r: -r.max_tokens):
        r.capture()
    return decode, verify
