"""Verify steps through the CUDA-graph hand-over, on CPU (EagerGraph) and, `gpu`-marked, with
real CUDA graphs: a batch of verify rows with the same proposal count replays its graph, padded
to the next captured size (3 -> 4), and gives eager's tokens, acceptance counts and logits, with
proposals in the plan or made by a draft model; padding rows write no K/V; a batch that mixes
verify rows with a prefill chunk, or rows of different proposal counts, runs eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from workers_testlib import LocalExecutor, same_results, step_plan

from scheduler.plan import DRAFT_TOKEN, NewSeq, StepPlan
from scheduler.sampling_params import SamplingParams
from workers.cuda_graph import EagerGraph

K = 2
CONFIG = dict(num_gpu_blocks=24, num_cpu_blocks=2, max_model_len=128, max_num_seqs=4,
              num_speculative_tokens=K, speculative_max_num_seqs=4)
PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5),
          SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=9)]
PROMPTS = [list(range(300, 310)), list(range(500, 517)), list(range(700, 705)),
           list(range(900, 930))]


def _new(i: int) -> NewSeq:
    return NewSeq(i, f"r{i}", 0, len(PROMPTS[i]), [], [4 * i + b for b in range(4)], PARAMS[i])


def _logged_sizes(ex: LocalExecutor) -> list[tuple[int, int]]:
    """(query length of the replayed graph or 0, graph size) of every step ex prepares."""
    runner = ex.worker.model_runner
    sizes: list[tuple[int, int]] = []
    prepare = runner.prepare

    def logged(plan):
        batch = prepare(plan)
        sizes.append((0 if batch.graphs is None else batch.graphs.query_len, batch.graph_size))
        return batch

    runner.prepare = logged
    return sizes


def check_verify_steps(eager: LocalExecutor, graphs: LocalExecutor, atol: float) -> None:
    """The same plans on a worker without graphs and one with them: equal results; which
    steps replayed which graph; the caches equal at the end. With a draft model (the target's
    own weights) also a verify step whose proposals the draft makes (all accepted)."""
    runner = graphs.worker.model_runner
    assert sorted(runner.graph_runner.graphs) == [1, 2, 4]
    assert {q: sorted(r.graphs) for q, r in runner.verify_graph_runners.items()} == {
        2: [1], K + 1: [1, 2, 4]}
    sizes = _logged_sizes(graphs)
    for ex in (eager, graphs):  # (CPU caches start uninitialized: compared at the end)
        ex.worker.cache_engine.gpu_cache.zero_()

    def both(plan: StepPlan):
        return same_results(eager, graphs, plan, atol)

    first = both(step_plan(1, [0, 1, 2], [len(p) for p in PROMPTS[:3]], [0, 0, 0],
                           sum(PROMPTS[:3], []), new_seqs=[_new(i) for i in range(3)]))
    last = first.token_ids.tolist()
    pos = [len(p) for p in PROMPTS[:3]]
    # three verify rows of K proposals each (made-up proposals)
    ids = [last[0], 0, 0, last[1], 11, 12, last[2], 13, 14]
    out = both(step_plan(2, [0, 1, 2], [K + 1] * 3, pos, ids, [K] * 3))
    assert sizes[-1] == (K + 1, 4)  # padded: 3 rows replay the graph of 4
    # a lone row's graph; with its true greedy tokens as proposals it accepts them all
    g0 = int(out.token_ids[0])
    g1 = int(both(step_plan(3, [0], [K + 1], [pos[0]], [last[0], g0, 0], [K])).token_ids[1])
    assert sizes[-1] == (K + 1, 1)
    out = both(step_plan(4, [0], [K + 1], [pos[0]], [last[0], g0, g1], [K]))
    assert out.num_tokens.tolist() == [K + 1]
    if graphs.worker.drafter is not None:  # the draft proposes what the target then accepts
        out = both(step_plan(5, [0, 1, 2], [K + 1] * 3, pos,
                             [t for x in last for t in (x, DRAFT_TOKEN, DRAFT_TOKEN)], [K] * 3))
        # (the greedy rows accept everything; row 1 samples at temperature 1)
        assert sizes[-1] == (K + 1, 4) and out.num_tokens[[0, 2]].tolist() == [K + 1] * 2
        assert out.token_ids[:K].tolist() == [g0, g1]
        # the draft's proposals beside given ones: eager
        both(step_plan(6, [0, 2], [K + 1] * 2, [pos[0], pos[2]],
                       [last[0], DRAFT_TOKEN, DRAFT_TOKEN, last[2], 41, 42], [K] * 2))
        assert sizes[-1] == (0, 0)
    # one row of fewer proposals: the lone sequence's graph of q = 2
    both(step_plan(14, [1], [2], [pos[1]], [last[1], 21], [1]))
    assert sizes[-1] == (2, 1)
    # verify rows beside a prefill chunk, and rows of different proposal counts: eager
    both(step_plan(15, [0, 2, 3], [K + 1, K + 1, 12], [pos[0] + 1, pos[2], 0],
                   [g0, 31, 32, last[2], 33, 34, *PROMPTS[3][:12]], [K, K, 0], new_seqs=[_new(3)]))
    both(step_plan(16, [0, 2], [K + 1, 2], [pos[0] + 2, pos[2] + 1], [5, 6, 7, 8, 9], [K, 1]))
    assert sizes[-2:] == [(0, 0), (0, 0)]
    # padding rows wrote no K/V (the target's nor the draft's): the caches hold the same values
    np.testing.assert_allclose(graphs.worker.cache_engine.gpu_cache.cpu().numpy(),
                               eager.worker.cache_engine.gpu_cache.cpu().numpy(), atol=atol,
                               rtol=0)
    done = step_plan(17, [], [], [], [], dropped_seq_ids=[0, 1, 2, 3])
    eager.execute(done)
    graphs.execute(done)


def test_verify_batches_replay_padded_graphs_and_mixed_batches_run_eager(tiny_dir) -> None:
    """On CPU through EagerGraph, with the target's own weights as a draft model."""
    eager = LocalExecutor(model=tiny_dir, speculative_model=tiny_dir, **CONFIG)
    graphs = LocalExecutor(model=tiny_dir, speculative_model=tiny_dir, **CONFIG)
    try:
        graphs.worker.capture_graphs(EagerGraph)
        check_verify_steps(eager, graphs, atol=1e-5)
    finally:
        eager.close()
        graphs.close()


@pytest.mark.gpu
@pytest.mark.parametrize("draft", [False, True])
def test_cuda_verify_graphs_equal_eager(tiny_dir, draft: bool) -> None:
    """Real CUDA graphs (captured by init_cache), fp32, with and without a draft model."""
    cfg = dict(CONFIG, device="cuda", dtype="float32",
               speculative_model=tiny_dir if draft else None)
    eager = LocalExecutor(model=tiny_dir, enforce_eager=True, **cfg)
    graphs = LocalExecutor(model=tiny_dir, **cfg)
    try:
        assert eager.worker.model_runner.graph_runner is None
        check_verify_steps(eager, graphs, atol=1e-4)
    finally:
        eager.close()
        graphs.close()


@pytest.mark.gpu
def test_cuda_verify_step_with_a_draft_never_syncs(tiny_dir) -> None:
    """A verify step (the draft's proposals, the verify graph, acceptance, the draft's follow
    graph) launches under sync debug mode "error": any implicit device sync raises."""
    ex = LocalExecutor(model=tiny_dir, device="cuda", dtype="float32", speculative_model=tiny_dir,
                       **CONFIG)
    try:
        w = ex.worker
        w.execute(step_plan(1, [0, 1, 2], [len(p) for p in PROMPTS[:3]], [0, 0, 0],
                            sum(PROMPTS[:3], []), new_seqs=[_new(i) for i in range(3)]))
        pos = [len(p) for p in PROMPTS[:3]]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(2, 6):
                w.launch(step_plan(step, [0, 1, 2], [K + 1] * 3, pos,
                                   [7, DRAFT_TOKEN, DRAFT_TOKEN] * 3, [K] * 3))
                assert w._launched[-1].batch.graph_size == 4
                result = w.collect(step)[0]  # the designed wait
                assert result.num_tokens[[0, 2]].tolist() == [K + 1] * 2  # (greedy rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        ex.close()
