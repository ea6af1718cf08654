"""Speculative decoding through the CUDA-graph path on CPU (EagerGraph replays the captured
functions eagerly, so every line of the graph hand-over runs): verify steps (every sequence k + 1
tokens) replay the verify graphs, padded to the next captured batch size; decode steps replay
the decode graphs with a draft model too, whose follow forward replays its own graph; steps
that mix verify rows with prefill chunks run eager (tests/workers/test_verify_graphs.py pins
that and the padded rows' logits). Greedy tokens equal those of speculation off (n-gram;
draft = the target itself, every proposal accepted; a random draft, most rejected).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from cluster import LLM, SamplingParams
from workers.cuda_graph import EagerGraph

# small cache (12 blocks of 16) and a 48-token step budget: the long prompt is chunked; at most
# 4 sequences (all this workload runs at once): graphs of 1, 2 and 4
ENGINE = dict(model="qwen3-tiny", device="cpu", executor="inprocess", num_gpu_blocks_override=12,
              max_num_batched_tokens=48, max_num_seqs=4, max_model_len=256)
K = 4
# n = 3 greedy copies of one prompt run in lockstep (the same proposals, the same acceptance):
# beside the other prompt they verify as a batch of 4, once it finishes as 3 (the graph of 4)
GREEDY = [SamplingParams(temperature=0.0, max_tokens=22, ignore_eos=True, n=3),
          SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]


def _prompts() -> list[dict]:
    rng = random.Random(3)
    motif = [rng.randrange(100, 150000) for _ in range(5)]
    return [{"prompt_token_ids": motif * 4 + [rng.randrange(100, 150000)]},
            {"prompt_token_ids": [rng.randrange(100, 150000) for _ in range(70)]}]


class StepLog:
    """The engine's worker with EagerGraph graphs, and what each step ran: (graph kind, number
    of sequences, graph size, any verify row, any prefill chunk)."""

    def __init__(self, llm: LLM) -> None:
        worker = llm.engine.executor.worker
        worker.capture_graphs(EagerGraph)
        self.runner = runner = worker.model_runner
        self.graphs = (runner.graph_runner, runner.verify_graph_runners)
        self.steps: list[tuple] = []
        prepare = runner.prepare

        def logged(plan):
            batch = prepare(plan)
            drafts = (np.zeros(plan.num_seqs, np.int64) if plan.num_draft_tokens is None
                      else plan.num_draft_tokens.astype(np.int64))
            kind = "eager" if batch.graphs is None else (
                "decode" if batch.graphs is runner.graph_runner else "verify")
            self.steps.append((kind, plan.num_seqs, batch.graph_size, bool((drafts > 0).any()),
                               bool((plan.query_lens > drafts + 1).any())))
            return batch

        runner.prepare = logged

    def run(self, llm: LLM, params: list[SamplingParams]) -> list:
        """Tokens of each completion."""
        self.steps.clear()
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs]

    def count(self, kind: str, padded: bool = False) -> int:
        return sum(1 for k, n, size, _, _ in self.steps if k == kind and (size > n or not padded))


def _spec(**cfg) -> dict:
    return {"num_speculative_tokens": K, "disable_by_batch_size": 16, **cfg}


@pytest.fixture(scope="module")
def off() -> list:
    return [[c.token_ids for c in o.outputs]
            for o in LLM(**ENGINE).generate(_prompts(), GREEDY, use_tqdm=False)]


def _check(llm: LLM, off: list, padded: bool = True) -> StepLog:
    """With graphs, the tokens of speculation off (which are those of speculation on without
    graphs: test_speculative_engine.py, test_draft_model_engine.py); the run replayed verify
    graphs (padded ones too) and decode graphs, never a verify graph beside a prefill."""
    log = StepLog(llm)
    spec = llm.engine.scheduler.spec
    assert sorted(log.graphs[0].graphs) == [1, 2, 4]
    assert {q: sorted(r.graphs) for q, r in log.graphs[1].items()} == {
        2: [1], 3: [1], 4: [1], K + 1: [1, 2, 4]}
    assert log.run(llm, GREEDY) == off
    assert spec.num_draft_tokens > 10
    assert log.count("verify") > 0 and (log.count("verify", padded=True) > 0 or not padded)
    assert log.count("decode") > 0
    assert all(k != "verify" or not prefill for k, _, _, _, prefill in log.steps)
    kv = llm.engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_gpu_blocks == kv.num_gpu_blocks
    return log


def test_ngram_verify_graphs_give_the_tokens_of_speculation_off(off) -> None:
    with LLM(**ENGINE, speculative_config=_spec(method="ngram", prompt_lookup_max=3)) as llm:
        _check(llm, off)


def test_self_draft_verify_and_follow_graphs_accept_every_proposal(off) -> None:
    with LLM(**ENGINE, speculative_config=_spec(model="qwen3-tiny")) as llm:
        runner = llm.engine.executor.worker.model_runner
        follows = []
        follow = runner.follow
        runner.follow = lambda batch, drafter: (follows.append(batch.graph_size),
                                                follow(batch, drafter))
        _check(llm, off)
        spec = llm.engine.scheduler.spec
        assert spec.num_accepted_tokens == spec.num_draft_tokens  # acceptance 100 %
        assert 4 in follows and 0 in follows  # graph steps replayed the draft's follow graph


def test_random_draft_through_graphs_changes_no_token(off) -> None:
    with LLM(**ENGINE, speculative_config=_spec(model="qwen3-tiny-draft")) as llm:
        _check(llm, off, padded=False)  # (its rows' acceptance differs: fewer lockstep steps)
        spec = llm.engine.scheduler.spec
        assert spec.num_accepted_tokens < 0.3 * spec.num_draft_tokens
