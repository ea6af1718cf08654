"""CUDA graphs per pipeline stage (workers/cuda_graph.py): each stage captures its own part of
a decode step (the first from input ids to the hidden states and residual it sends, a middle
one from received to sent ones, the last from received ones through the logits and sampling)
over static buffers the hand-over reads and writes, so a replay allocates nothing.

On CPU the graphs are EagerGraphs (the same hand-over, captured functions run again): stages
in one process with the hidden states handed over by hand (also `gpu`-marked, with real CUDA
graphs on one device), and two spawned ranks over gloo's send/recv (with NCCL where there are
two GPUs). Greedy tokens and logits are transformers'; decode batches of 3 replay the graph of
4 on every stage."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch
from workers_testlib import (
    NUM_GREEDY_TOKENS,
    LocalExecutor,
    PlanBuilder,
    ProcessGroupExecutor,
    log_graph_sizes,
    same_results,
    step_plan,
)

from cluster.engine.config import EngineConfig
from cluster.engine.engine_setup import build_worker_config
from scheduler.plan import NewSeq, StepPlan
from scheduler.sampling_params import SamplingParams
from workers.config import WorkerConfig
from workers.cuda_graph import EagerGraph
from workers.pipeline import PipelineStage
from workers.worker import Worker

CONFIG = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, dtype="float32")
NUM_BLOCKS = 64
# per prompt: how many of transformers' greedy tokens to generate (decode batches 4, 3, 2, 1)
MAX_TOKENS = (NUM_GREEDY_TOKENS, 20, 12, 6)
HIDDEN = 128  # qwen3-tiny's hidden_size
VOCAB = 151936


class _ByHand(PipelineStage):
    """A stage whose hand-over is a FIFO in this process (the hidden states handed over by
    hand, in the order the stages run); records which tensors it sent from and received into."""

    def __init__(self, rank: int, size: int, inbox: deque | None, outbox: deque | None) -> None:
        super().__init__(rank, size, global_rank=rank, tp_size=1)
        self.inbox, self.outbox = inbox, outbox
        self.sent_from: list[int] = []
        self.received_into: list[int] = []

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        self.sent_from.append(hidden.data_ptr())
        self.outbox.append((hidden.clone(), residual.clone()))

    def recv_into(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        self.received_into.append(hidden.data_ptr())
        sent_hidden, sent_residual = self.inbox.popleft()
        hidden.copy_(sent_hidden)
        residual.copy_(sent_residual)


def _stages(tiny_dir: str, partition: str, device: str, **extra) -> list[Worker]:
    """One Worker per stage of `partition`, in this process, built first to last (on CUDA
    each runs its warm-up's steps as it starts, so the next one receives them in order)."""
    size = len(partition.split(","))
    wires = [deque() for _ in range(size - 1)]
    workers = []
    for rank in range(size):
        w = Worker(WorkerConfig(model=tiny_dir, device=device, pp_layer_partition=partition,
                                **CONFIG, **extra))
        w.init_distributed()
        w.stage = _ByHand(rank, size, wires[rank - 1] if rank else None,
                          wires[rank] if rank < size - 1 else None)
        w.load_model()
        w.init_cache(NUM_BLOCKS, 2)  # (CUDA: captures the stage's graphs)
        if device == "cpu":
            w.capture_graphs(EagerGraph)
        workers.append(w)
    assert not any(wires)
    for w in workers:
        w.stage.sent_from.clear()
        w.stage.received_into.clear()
    return workers


class _Pipeline:
    """Runs a plan through the stages in order; the last stage's result and logits."""

    def __init__(self, stages: list[Worker]) -> None:
        self.stages = stages

    def execute(self, plan):
        for w in self.stages[:-1]:
            w.execute(plan)
        result, logits = self.stages[-1].execute_with_logits(plan)
        return result, None if logits is None else logits.float().cpu().numpy().copy()


def _greedy(executor, prompts) -> PlanBuilder:
    builder = PlanBuilder(block_size=16, num_gpu_blocks=NUM_BLOCKS, token_budget=24)
    for p, n in zip(prompts, MAX_TOKENS):
        builder.add(p, SamplingParams(temperature=0), max_tokens=n)
    builder.run(executor)
    return builder


def _check_tokens(builder: PlanBuilder, reference, atol: float) -> None:
    for sid, (tokens, logits) in enumerate(reference):
        n = MAX_TOKENS[sid]
        assert builder.seqs[sid].outputs == tokens[:n]
        np.testing.assert_allclose(np.stack(builder.seqs[sid].logits), np.stack(logits[:n]),
                                   atol=atol, rtol=0)


@pytest.mark.parametrize("partition", ["3,1", "2,1,1"])
def test_each_stage_captures_its_part_over_static_hand_over_buffers(tiny_dir,
                                                                    partition: str) -> None:
    stages = _stages(tiny_dir, partition, "cpu")
    try:
        for w in stages:
            first, last = w.stage.is_first, w.stage.is_last
            graphs = w.model_runner.graph_runner.graphs
            assert sorted(graphs) == [1, 2, 4]
            for bs, g in graphs.items():
                if first:
                    assert g.received is None
                else:
                    assert [tuple(t.shape) for t in g.received] == [(bs, HIDDEN)] * 2
                    assert all(t.dtype == torch.float32 for t in g.received)
                if last:
                    assert g.sent is None
                    assert (tuple(g.logits.shape), tuple(g.tokens.shape)) == ((bs, VOCAB), (bs,))
                else:
                    assert [tuple(t.shape) for t in g.sent] == [(bs, HIDDEN)] * 2
                    assert g.logits is None and g.tokens is None
        # the stage forward split: only the first embeds, only the last holds norm and head
        assert [w.model.model.embed_tokens is not None for w in stages] == \
            [True] + [False] * (len(stages) - 1)
        assert [w.model.lm_head is not None for w in stages] == [False] * (len(stages) - 1) + [True]
    finally:
        for w in stages:
            w.shutdown()


def _check_by_hand(tiny_dir: str, oracle, partition: str, device: str, atol: float) -> None:
    prompts, reference = oracle("tiny")
    stages = _stages(tiny_dir, partition, device)
    try:
        logs = [log_graph_sizes(w) for w in stages]
        builder = _greedy(_Pipeline(stages), prompts)
        _check_tokens(builder, reference, atol)
        # every stage replays the same graph for a step; 3 sequences pad to the graph of 4
        assert all(log == logs[0] for log in logs)
        graph_steps = [s for s in logs[0] if s]
        assert {4, 2, 1} <= set(graph_steps) and logs[0].count(0) > 0
        # each graph step's hand-over: sent from the graph's outputs, received into its inputs
        for w in stages:
            graphs = w.model_runner.graph_runner.graphs.values()
            if not w.stage.is_last:
                static = {g.sent[0].data_ptr() for g in graphs}
                assert sum(p in static for p in w.stage.sent_from) == len(graph_steps)
            if not w.stage.is_first:
                static = {g.received[0].data_ptr() for g in graphs}
                assert sum(p in static for p in w.stage.received_into) == len(graph_steps)
    finally:
        for w in stages:
            w.shutdown()


@pytest.mark.parametrize("partition", ["3,1", "2,1,1"])
def test_stage_graphs_with_the_hand_over_by_hand_match_transformers(tiny_dir, oracle,
                                                                    partition: str) -> None:
    _check_by_hand(tiny_dir, oracle, partition, "cpu", atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("partition", ["3,1", "2,1,1"])
def test_cuda_stage_graphs_with_the_hand_over_by_hand_match_transformers(tiny_dir, oracle,
                                                                         partition: str) -> None:
    """Real CUDA graphs per stage on one device (fp32); Triton attention against CPU
    transformers: the CUDA parity tests' bound."""
    _check_by_hand(tiny_dir, oracle, partition, "cuda", atol=2e-3)


def _check_verify(tiny_dir: str, device: str, atol: float) -> None:
    """n-gram speculation's verify steps (proposals in the plan) at pp 2: each stage replays
    its verify graph (3 rows of k proposals pad to 4; a lone row its own), and the tokens,
    acceptance counts and logits are the whole model's, run eager on one stage."""
    k = 2
    spec = dict(num_speculative_tokens=k, speculative_max_num_seqs=4)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=0)]
    prompts = [list(range(300, 310)), list(range(500, 517)), list(range(700, 705))]
    eager = LocalExecutor(model=tiny_dir, device=device, enforce_eager=True,
                          num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=2, **CONFIG, **spec)
    stages = _stages(tiny_dir, "3,1", device, **spec)
    try:
        pipeline = _Pipeline(stages)
        logs = [log_graph_sizes(w) for w in stages]
        for w in stages:
            assert {q: sorted(r.graphs) for q, r in
                    w.model_runner.verify_graph_runners.items()} == {2: [1], k + 1: [1, 2, 4]}

        def both(plan: StepPlan):
            return same_results(eager, pipeline, plan, atol)

        new = [NewSeq(i, f"r{i}", 0, len(p), [], [4 * i + b for b in range(4)], params[i])
               for i, p in enumerate(prompts)]
        first = both(step_plan(1, [0, 1, 2], [len(p) for p in prompts], [0, 0, 0], sum(prompts, []),
                               new_seqs=new))
        last = first.token_ids.tolist()
        pos = [len(p) for p in prompts]
        both(step_plan(2, [0, 1, 2], [k + 1] * 3, pos,
                       [last[0], 0, 0, last[1], 11, 12, last[2], 13, 14], [k] * 3))
        assert [log[-1] for log in logs] == [4, 4]  # padded: 3 rows replay the graph of 4
        # a lone row with its true greedy tokens as proposals accepts them all
        out = both(step_plan(3, [0], [k + 1], [pos[0]], [last[0], 0, 0], [k]))
        g0 = int(out.token_ids[0])
        g1 = int(both(step_plan(4, [0], [k + 1], [pos[0]], [last[0], g0, 0], [k])).token_ids[1])
        out = both(step_plan(5, [0], [k + 1], [pos[0]], [last[0], g0, g1], [k]))
        assert out.num_tokens.tolist() == [k + 1]
        assert [log[-3:] for log in logs] == [[1, 1, 1]] * 2
        # one row of fewer proposals: the lone sequence's graph of q = 2
        both(step_plan(6, [2], [2], [pos[2]], [last[2], 21], [1]))
        assert [log[-1] for log in logs] == [1, 1]
    finally:
        eager.close()
        for w in stages:
            w.shutdown()


def test_stage_verify_graphs_by_hand_equal_the_whole_model_eager(tiny_dir) -> None:
    _check_verify(tiny_dir, "cpu", atol=1e-5)


@pytest.mark.gpu
def test_cuda_stage_verify_graphs_by_hand_equal_the_whole_model_eager(tiny_dir) -> None:
    """Real CUDA verify graphs per stage against the whole model eager on CUDA (fp32)."""
    _check_verify(tiny_dir, "cuda", atol=1e-4)


def _check_two_ranks(tiny_dir: str, oracle, device: str, atol: float) -> None:
    prompts, reference = oracle("tiny")
    group = ProcessGroupExecutor(world_size=2)
    try:
        group.init(model=tiny_dir, device=device, num_gpu_blocks=NUM_BLOCKS,
                   pipeline_parallel_size=2, eager_graphs=device == "cpu", **CONFIG)
        _check_tokens(_greedy(group, prompts), reference, atol)
        states = group.state()
        assert [s["graph_sizes"] for s in states] == [[1, 2, 4]] * 2
        assert states[0]["graph_steps"] == states[1]["graph_steps"]
        assert {4, 2, 1} <= set(states[0]["graph_steps"])
        group.shutdown_workers()
    finally:
        group.close()


def test_two_ranks_replay_stage_graphs_over_gloo_send_recv(tiny_dir, oracle) -> None:
    _check_two_ranks(tiny_dir, oracle, "cpu", atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="two NCCL ranks need two GPUs (NCCL refuses two ranks on one device)")
def test_cuda_two_ranks_replay_stage_graphs_over_nccl(tiny_dir, oracle) -> None:
    _check_two_ranks(tiny_dir, oracle, "cuda", atol=2e-3)


def test_pipeline_parallel_keeps_cuda_graphs_on() -> None:
    """The workers accept pp > 1 on CUDA with graphs, and the engine no longer turns them off;
    enforce_eager still does."""
    cfg = WorkerConfig(model="m", device="cuda", pipeline_parallel_size=2,
                       dist_init_method="tcp://127.0.0.1:1")
    assert not cfg.enforce_eager
    for eager in (False, True):
        engine = EngineConfig(pipeline_parallel_size=2, enforce_eager=eager)
        wc = build_worker_config(engine, "m", "cuda", 512, 2048, None, None, None)
        assert (wc.pipeline_parallel_size, wc.enforce_eager) == (2, eager)
