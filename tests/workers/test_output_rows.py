"""The last layer computes only the rows a step samples (OutputRows, workers/qwen3.py): prompt
chunks that sample nothing and the rows before a prompt's last skip its attention queries,
o_proj and MLP, and every sampled row's logits are those of computing every row."""

from __future__ import annotations

import numpy as np
import pytest
from workers_testlib import LocalExecutor, PlanBuilder, parity_prompts

from scheduler.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def executor(tiny_dir: str):
    ex = LocalExecutor(model=tiny_dir, num_gpu_blocks=64, num_cpu_blocks=4, max_model_len=512)
    yield ex
    ex.close()


class _MlpRows:
    """Rows each step's first and last MLP computed (forward hooks on the real layers)."""

    def __init__(self, executor: LocalExecutor) -> None:
        layers = executor.worker.model.model.layers
        self.first: list[int] = []
        self.last: list[int] = []
        self._hooks = [
            layers[0].mlp.register_forward_hook(lambda m, a, o: self.first.append(a[0].shape[0])),
            layers[-1].mlp.register_forward_hook(lambda m, a, o: self.last.append(a[0].shape[0]))]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def _run(executor: LocalExecutor, prune: bool, params: SamplingParams
         ) -> tuple[PlanBuilder, dict[int, list[int]], _MlpRows, list[int]]:
    runner = executor.worker.model_runner
    saved = runner._prunes
    runner._prunes = prune
    rows = _MlpRows(executor)
    sampled: list[int] = []  # sampled rows per step
    builder = PlanBuilder(num_gpu_blocks=64, token_budget=24)
    for prompt in parity_prompts(executor.worker.model_config.vocab_size):
        builder.add(prompt, params, max_tokens=6)
    try:
        for _ in range(200):
            plan = builder.next_plan()
            if plan is None:
                break
            if params.prompt_logprobs is not None:  # (the engine sends the whole prompt)
                for new in plan.new_seqs:
                    new.prompt_token_ids = builder.seqs[new.seq_id].tokens[:new.prompt_len]
            result, logits = executor.execute(plan)
            sampled.append(int(np.count_nonzero(plan.do_sample)))
            builder.apply(plan, result, logits)
    finally:
        runner._prunes = saved
        rows.close()
    return builder, {sid: s.outputs for sid, s in builder.seqs.items()}, rows, sampled


def test_last_layer_runs_the_sampled_rows_only_with_the_same_logits(executor) -> None:
    greedy = SamplingParams(temperature=0, logprobs=2)  # (logprobs: the step returns logits)
    full_b, full_out, full_rows, sampled = _run(executor, False, greedy)
    b, out, rows, sampled_again = _run(executor, True, greedy)
    assert sampled == sampled_again
    # every row everywhere without it; with it the last layer's rows are the sampled ones
    assert full_rows.last == full_rows.first == rows.first
    # (a chunk that samples nothing keeps its rows: nothing to choose)
    assert rows.last == [n if n else t for n, t in zip(sampled, rows.first)]
    assert [n for n, t in zip(rows.last, rows.first) if n < t], "no step skipped a row"
    assert sum(rows.last) < sum(rows.first) // 2  # prompts of 5-40 tokens: most rows skipped
    # the same tokens and the same logits (fp32; the sampled rows' attention reads the cache)
    assert out == full_out
    for sid, s in b.seqs.items():
        assert len(s.logits) == len(full_b.seqs[sid].logits) == 6
        for got, want in zip(s.logits, full_b.seqs[sid].logits):
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


def test_prompt_logprobs_keep_every_row(executor) -> None:
    params = SamplingParams(temperature=0, prompt_logprobs=1)
    _, _, rows, sampled = _run(executor, True, params)
    # every prompt chunk's rows give prompt logprobs: no step is pruned while one is in it
    prefill_steps = [i for i, (n, t) in enumerate(zip(sampled, rows.first)) if n < t]
    assert prefill_steps
    assert all(rows.last[i] == rows.first[i] for i in prefill_steps)
