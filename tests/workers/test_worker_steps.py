"""Worker.execute end to end on qwen3-tiny (tp = 1): sampling through plans, result fields,
state diffs, and plan errors."""

from __future__ import annotations

import numpy as np
import pytest
from workers_testlib import LocalExecutor, PlanBuilder

from scheduler.plan import PENDING_TOKEN, NewSeq, StepPlan
from scheduler.sampling_params import SamplingParams
from workers.config import WorkerConfig
from workers.worker import Worker


@pytest.fixture(scope="module")
def executor(tiny_dir: str):
    ex = LocalExecutor(model=tiny_dir, num_gpu_blocks=64, num_cpu_blocks=4, max_model_len=512)
    yield ex
    ex.close()


SEEDED = SamplingParams(temperature=3.0, seed=2024)


def _run(executor, prompts_params: list[tuple[list[int], SamplingParams]],
         max_tokens: int = 10) -> tuple[PlanBuilder, dict[int, list[int]]]:
    builder = PlanBuilder(num_gpu_blocks=64, token_budget=32)
    for prompt, params in prompts_params:
        builder.add(prompt, params, max_tokens=max_tokens)
    return builder, builder.run(executor)


def test_seeded_request_same_tokens_alone_or_batched(executor) -> None:
    prompt = list(range(500, 520))
    _, alone = _run(executor, [(prompt, SEEDED)])
    _, batched = _run(executor, [(list(range(7, 40)), SamplingParams(temperature=1.0)),
                                 (list(range(900, 905)), SamplingParams(seed=5)),
                                 (prompt, SEEDED),
                                 (list(range(60, 80)), SamplingParams(temperature=0))])
    assert batched[2] == alone[0]
    # Temperature 3 on the toy model really samples (not a greedy run in disguise).
    _, greedy = _run(executor, [(prompt, SamplingParams(temperature=0))])
    assert alone[0] != greedy[0]


def test_step_result_carries_logprobs(executor) -> None:
    builder, out = _run(executor, [(list(range(30, 50)), SamplingParams(temperature=0, logprobs=3)),
                                   (list(range(80, 90)), SamplingParams(temperature=0))],
                        max_tokens=3)
    for sid in (0, 1):
        assert len(builder.seqs[sid].results) == 3  # every sampled row gets logprobs
    for (lp, top_ids, top_lps), logits, tok in zip(builder.seqs[0].results,
                                                    builder.seqs[0].logits, out[0]):
        shifted = logits - logits.max()
        ref = shifted - np.log(np.exp(shifted).sum())
        assert top_ids[0] == tok and top_ids.shape == (3,)
        np.testing.assert_allclose(lp, ref[tok], atol=1e-5)
        np.testing.assert_allclose(top_lps, ref[top_ids], atol=1e-5)


def test_penalties_change_greedy_repeats(executor) -> None:
    prompt = [101, 102, 103] * 5
    _, plain = _run(executor, [(prompt, SamplingParams(temperature=0))], max_tokens=12)
    _, penalised = _run(executor, [(prompt, SamplingParams(temperature=0, presence_penalty=2.0,
                                                           repetition_penalty=2.0))],
                        max_tokens=12)
    assert len(set(penalised[0])) >= len(set(plain[0]))
    # With a presence penalty of 2 no generated token is chosen twice in a row on this model.
    assert all(a != b for a, b in zip(penalised[0], penalised[0][1:]))


def _plan(step: int, seq_ids, qlens, starts, ids, sample, **kw) -> StepPlan:
    return StepPlan(step, np.array(seq_ids, np.int64), np.array(qlens, np.int32),
                    np.array(starts, np.int32), np.array(ids, np.int64), np.array(sample, bool), **kw)


def test_plan_errors_are_value_errors(executor) -> None:
    params = SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="no state"):
        executor.execute(_plan(0, [99], [1], [0], [5], [True]))
    short = NewSeq(50, "r", 0, 20, [], [0], params)  # 20 tokens need 2 blocks of 16
    with pytest.raises(ValueError, match="needs 2 blocks"):
        executor.execute(_plan(1, [50], [20], [0], list(range(20)), [True], new_seqs=[short]))
    executor.execute(_plan(2, [], [], [], [], [], dropped_seq_ids=[50]))
    assert 50 not in executor.worker.model_runner.seqs
    bad_block = NewSeq(51, "r", 0, 2, [], [64], params)
    with pytest.raises(ValueError, match="cache has 64 blocks"):
        executor.execute(_plan(3, [51], [2], [0], [1, 2], [True], new_seqs=[bad_block]))
    executor.execute(_plan(4, [], [], [], [], [], dropped_seq_ids=[51]))


def test_empty_plan_returns_empty_result(executor) -> None:
    result = executor.worker.execute(_plan(7, [], [], [], [], []))
    assert result.step_id == 7 and result.token_ids.shape == (0,)


def test_chunk_without_sampling_returns_no_tokens(executor) -> None:
    new = NewSeq(60, "r", 0, 40, [], [0, 1, 2], SamplingParams(temperature=0))
    result = executor.worker.execute(_plan(8, [60], [16], [0], list(range(16)), [False],
                                           new_seqs=[new]))
    assert result.seq_ids.shape == (0,) and result.token_ids.shape == (0,)
    executor.worker.execute(_plan(9, [], [], [], [], [], dropped_seq_ids=[60]))


def test_pending_token_is_the_one_sampled_in_the_plan_before(executor) -> None:
    """Async scheduling: a decode scheduled before the previous plan's result is known."""
    params = SamplingParams(temperature=0)
    prompt = list(range(300, 310))
    new = NewSeq(70, "r", 0, 10, [], [0], params)
    first = executor.worker.execute(_plan(20, [70], [10], [0], prompt, [True], new_seqs=[new]))
    token = int(first.token_ids[0])
    second = executor.worker.execute(_plan(21, [70], [1], [10], [PENDING_TOKEN], [True]))
    table = executor.worker.model_runner.table
    assert table.num_tokens[table.seqs[70].row] == 11
    # The same as a plan that names the token outright.
    again = NewSeq(71, "r", 0, 10, [], [1], params)
    executor.worker.execute(_plan(22, [71], [10], [0], prompt, [True], new_seqs=[again]))
    named = executor.worker.execute(_plan(23, [71], [1], [10], [token], [True]))
    assert second.token_ids.tolist() == named.token_ids.tolist()
    # A pending token must refer to the plan just before, for a sequence it sampled.
    with pytest.raises(ValueError, match="last plan this worker sampled for was 23"):
        executor.worker.execute(_plan(25, [70], [1], [11], [PENDING_TOKEN], [True]))
    with pytest.raises(ValueError, match=r"pending tokens for seqs \[70\], which plan 23 did not"):
        executor.worker.execute(_plan(24, [70], [1], [11], [PENDING_TOKEN], [True]))
    executor.worker.execute(_plan(26, [], [], [], [], [], dropped_seq_ids=[70, 71]))


def test_execute_before_init_cache_is_an_error(tiny_dir: str) -> None:
    w = Worker(WorkerConfig(model=tiny_dir, max_model_len=512))
    w.init_distributed()
    w.load_model()
    with pytest.raises(RuntimeError, match="init_cache"):
        w.execute(_plan(0, [], [], [], [], []))


def test_calls_before_load_model_name_the_missing_step(tiny_dir: str) -> None:
    w = Worker(WorkerConfig(model=tiny_dir, max_model_len=512))
    w.init_distributed()
    for call in (w.kv_block_bytes, w.determine_num_blocks, lambda: w.init_cache(4, 0)):
        with pytest.raises(RuntimeError, match=r"^the worker has no model loaded; "
                                               r"call load_model\(\) first$"):
            call()
    assert w.cache_engine is None  # init_cache allocated nothing
