"""The worker's step loop on CPU: launch ahead / collect behind, pending tokens gathered on the
device, the persistent batch's device block table, the staging ring, and the decode-graph
hand-over (run through EagerGraph, which replays the captured function eagerly)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from workers_testlib import LocalExecutor, PlanBuilder, hf_greedy, parity_prompts

from scheduler.plan import PENDING_TOKEN, NewSeq, StepPlan
from scheduler.sampling_params import SamplingParams
from workers.cuda_graph import EagerGraph
from workers.seq_table import SeqRows
from workers.staging import InputStager
from workers.warmup import warmup_plans

GREEDY = SamplingParams(temperature=0)


def _plan(step: int, seq_ids, qlens, starts, ids, sample, **kw) -> StepPlan:
    return StepPlan(step, np.array(seq_ids, np.int64), np.array(qlens, np.int32),
                    np.array(starts, np.int32), np.array(ids, np.int64), np.array(sample, bool), **kw)


def _with_cpu_graphs(ex: LocalExecutor) -> LocalExecutor:
    """Install decode 'graphs' that replay eagerly: every line of the graph hand-over runs."""
    ex.worker.capture_graphs(EagerGraph)
    return ex


@pytest.fixture(scope="module")
def executors(tiny_dir: str):
    eager = LocalExecutor(model=tiny_dir, num_gpu_blocks=96, num_cpu_blocks=4, max_model_len=256,
                          max_num_seqs=8)
    graphs = _with_cpu_graphs(LocalExecutor(model=tiny_dir, num_gpu_blocks=96, num_cpu_blocks=4,
                                            max_model_len=256, max_num_seqs=8))
    yield eager, graphs
    eager.close()
    graphs.close()


def _decode_run(worker, prompts: list[list[int]], params: list[SamplingParams], steps: int,
                ahead: bool, first_step: int) -> list[list[int]]:
    """Prefill every prompt in one plan, then `steps` decodes of all of them with PENDING
    inputs. ahead: launch step N+1 before collecting N (as async scheduling does)."""
    n = len(prompts)
    seq_ids = list(range(first_step * 100, first_step * 100 + n))
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(n)]  # 64 tokens each
    new = [NewSeq(s, "r", 0, len(p), [], t, sp) for s, p, t, sp in zip(seq_ids, prompts, tables,
                                                                       params)]
    step = first_step
    plan = _plan(step, seq_ids, [len(p) for p in prompts], [0] * n,
                 [t for p in prompts for t in p], [True] * n, new_seqs=new)
    out = [[] for _ in range(n)]
    worker.launch(plan)
    launched = [step]
    pos = [len(p) for p in prompts]
    for _ in range(steps):
        step += 1
        plan = _plan(step, seq_ids, [1] * n, pos, [PENDING_TOKEN] * n, [True] * n)
        pos = [p + 1 for p in pos]
        if not ahead:
            res = worker.collect(launched.pop(0))[0]
            for i, t in enumerate(res.token_ids.tolist()):
                out[i].append(t)
        worker.launch(plan)
        launched.append(step)
        if ahead:
            res = worker.collect(launched.pop(0))[0]
            for i, t in enumerate(res.token_ids.tolist()):
                out[i].append(t)
    res = worker.collect(launched.pop(0))[0]
    for i, t in enumerate(res.token_ids.tolist()):
        out[i].append(t)
    worker.execute(_plan(step + 1, [], [], [], [], [], dropped_seq_ids=seq_ids))
    return out


def test_launch_ahead_equals_one_step_at_a_time(executors) -> None:
    eager, graphs = executors
    prompts = [list(range(100 + 9 * i, 120 + 11 * i)) for i in range(5)]
    params = [GREEDY, SamplingParams(temperature=1.5, seed=7), GREEDY,
              SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=1.0, seed=3)]
    base = _decode_run(eager.worker, prompts, params, 8, ahead=False, first_step=1000)
    assert _decode_run(eager.worker, prompts, params, 8, ahead=True, first_step=2000) == base
    # The graph path (padded to 8, sampling inside the 'graph') gives the same tokens.
    assert _decode_run(graphs.worker, prompts, params, 8, ahead=True, first_step=3000) == base
    # The seeded rows really sample: not the greedy continuation.
    greedy = _decode_run(eager.worker, prompts, [GREEDY] * 5, 8, ahead=False, first_step=4000)
    assert base[1] != greedy[1] and base[0] == greedy[0]


def test_cpu_graph_replay_matches_transformers(executors, tiny_dir: str) -> None:
    _, graphs = executors
    prompts = parity_prompts(151936)
    reference = hf_greedy(tiny_dir, prompts, 12)
    builder = PlanBuilder(block_size=16, num_gpu_blocks=96, token_budget=24)
    for p in prompts:
        builder.add(p, GREEDY, max_tokens=12)
    out = builder.run(graphs)
    for sid, (tokens, logits) in enumerate(reference):
        assert out[sid] == tokens
        np.testing.assert_allclose(np.stack(builder.seqs[sid].logits), np.stack(logits),
                                   atol=1e-4, rtol=0)


def test_collect_out_of_order_and_too_many_launched_are_errors(executors) -> None:
    eager, _ = executors
    w = eager.worker
    new = NewSeq(9000, "r", 0, 4, [], [0], GREEDY)
    w.launch(_plan(9000, [9000], [4], [0], [5, 6, 7, 8], [True], new_seqs=[new]))
    with pytest.raises(ValueError, match=r"collect\(9001\): the oldest launched step is 9000"):
        w.collect(9001)
    w.launch(_plan(9001, [9000], [1], [4], [PENDING_TOKEN], [True]))
    with pytest.raises(RuntimeError, match="2 steps launched and not collected"):
        w.launch(_plan(9002, [9000], [1], [5], [PENDING_TOKEN], [True]))
    first, second = w.collect(9000)[0], w.collect(9001)[0]
    assert first.seq_ids.tolist() == second.seq_ids.tolist() == [9000]
    w.execute(_plan(9003, [], [], [], [], [], dropped_seq_ids=[9000]))


def test_device_block_table_follows_the_plans_diffs(executors) -> None:
    eager, _ = executors
    w = eager.worker
    table = w.model_runner.table
    news = [NewSeq(8000 + i, "r", 0, 3, [], [10 + i], GREEDY) for i in range(3)]
    w.execute(_plan(8000, [8000, 8001, 8002], [3, 3, 3], [0, 0, 0], [1, 2, 3] * 3,
                    [False] * 3, new_seqs=news))
    w.execute(_plan(8001, [8000], [14], [3], list(range(14)), [False],
                    appended_blocks={8000: [40]}))
    w.execute(_plan(8002, [8001], [1], [3], [9], [False], replaced_tables={8001: [41]}))
    rows = [table.seqs[s].row for s in (8000, 8001, 8002)]
    for row in rows:
        n = int(table.num_blocks[row])
        assert table.device_block_table[row, :n].tolist() == table.block_table[row, :n].tolist()
    assert table.block_table[rows[0], :2].tolist() == [10, 40]
    assert table.block_table[rows[1], :1].tolist() == [41]
    w.execute(_plan(8003, [], [], [], [], [], dropped_seq_ids=[8000, 8001, 8002]))
    assert not {8000, 8001, 8002} & set(table.seqs)


def test_staging_views_hold_the_arrays_and_the_ring_keeps_earlier_steps() -> None:
    stager = InputStager(torch.device("cpu"), nbytes=256, depth=3)
    steps = []
    for k in range(3):
        a = np.arange(5, dtype=np.int64) + 10 * k
        b = np.array([k, -k], dtype=np.int32)
        c = np.array([0.5 * k], dtype=np.float32)
        (i64, i32, f32), regions = stager.stage([a, a[:2]], [b], [c])
        steps.append((i64, i32, f32, regions))
    for k, (i64, i32, f32, regions) in enumerate(steps):
        assert i64[0].tolist() == list(range(10 * k, 10 * k + 5))
        assert i64[1].tolist() == [10 * k, 10 * k + 1]
        assert i32[0].tolist() == [k, -k] and f32[0].tolist() == [0.5 * k]
        assert regions[0].tolist() == i64[0].tolist() + i64[1].tolist()
    big = np.arange(100, dtype=np.int64)
    (i64, _, _), _ = stager.stage([big], [], [])  # more than 256 bytes: the ring grows
    assert i64[0].tolist() == big.tolist() and stager.nbytes >= 800


def test_seq_rows_window_slides_and_grows() -> None:
    rows = SeqRows()
    live: dict[int, int] = {}
    rng = np.random.default_rng(0)
    next_id = 0
    for _ in range(3000):
        if live and rng.random() < 0.45:
            sid = int(rng.choice(list(live)))
            rows.set(sid, -1)
            del live[sid]
        else:
            live[next_id] = int(rng.integers(0, 1000))
            rows.set(next_id, live[next_id])
            next_id += rng.integers(1, 40)
    ids = np.array(sorted(live) + [next_id + 5], dtype=np.int64)
    assert rows.lookup(ids).tolist() == [live[i] for i in sorted(live)] + [-1]
    assert rows.rows.shape[0] < 4 * (next_id - rows.base + 1)
    rows.set(3, 77)  # ids need not grow (tests, a restarted scheduler): the window reaches back
    ids = np.array([3, *sorted(live)], dtype=np.int64)
    assert rows.lookup(ids).tolist() == [77] + [live[i] for i in sorted(live)]


def test_warm_up_covers_the_shape_classes_and_leaves_no_sequence(tiny_dir: str) -> None:
    plans = list(warmup_plans(16, 200, 512, 256, 8, eager_decode=True))
    qlens = {int(q) for p in plans if p.num_seqs == 1 for q in p.query_lens}
    assert {1, 15, 16, 17, 255, 256} <= qlens and max(qlens) <= 256
    assert any(p.num_seqs == 1 and p.start_pos[0] > 0 for p in plans)  # a cached prefix
    assert any(p.num_seqs > 1 and p.query_lens.max() > 1 and p.query_lens.min() == 1
               for p in plans)  # decodes beside a chunk
    sampled = {(sp.top_k > 0, sp.top_p < 1, sp.min_p > 0, sp.uses_penalties,
                sp.logprobs is not None, sp.seed is not None)
               for p in plans for n in p.new_seqs for sp in [n.sampling_params]}
    assert len(sampled) >= 7
    # a batch of plain temperature rows only, seeded and not, as large as max_num_seqs allows
    assert any(len(p.new_seqs) == 8 and {n.sampling_params.seed is None for n in p.new_seqs}
               == {True, False} and all(n.sampling_params.temperature > 0
                                        and not n.sampling_params.top_k > 0
                                        and n.sampling_params.top_p == 1 for n in p.new_seqs)
               for p in plans)
    ex = LocalExecutor(model=tiny_dir, num_gpu_blocks=200, num_cpu_blocks=4, max_model_len=512,
                       max_num_seqs=8, max_num_batched_tokens=256)
    try:
        ex.worker.warm_up()
        assert not ex.worker.model_runner.seqs
        result = ex.worker.execute(_plan(0, [1], [3], [0], [5, 6, 7], [True],
                                         new_seqs=[NewSeq(1, "r", 0, 3, [], [0], GREEDY)]))
        assert result.token_ids.shape == (1,)
    finally:
        ex.close()
