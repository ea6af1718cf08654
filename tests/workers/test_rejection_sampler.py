"""Acceptance of proposed tokens keeps the target's distribution exactly (chi-square).

A batch of verify rows, each the same context with one proposal x that the target often
disagrees with, goes through what the model runner does (`step_batch.verify_rows`: one sampled position
per proposal plus the bonus position, each with the random stream of its own output index),
the Sampler and `num_accepted`. The first emitted token must follow the target's processed
distribution p (at temperature 1, and with top_p 0.9), x must be accepted at rate p(x), and
after an accepted x the bonus token must follow p again. Keys are fixed: deterministic."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampler_distributions import BASE, chi2, chi2_bound, oracle

from workers.rejection_sampler import num_accepted
from workers.sampler import Sampler, SamplingMetadata, stream_key
from workers.step_batch import verify_rows as _verify_rows

N = 12000
X = 1  # the proposal: p(x) = 0.244 at temperature 1 (the target's second token)


def _verify(temperature: float, top_p: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first emitted token, accepted?, second emitted token or -1) for N verify rows."""
    drafts = np.ones(N, dtype=np.int64)
    logits_idx = np.arange(N, dtype=np.int64) * 2 + 1  # each row: [last token, x]
    input_ids = np.tile(np.array([7, X], dtype=np.int64), N)
    s_counter = np.full(N, 5, dtype=np.int64)  # 5 outputs after this step (4 before it)
    rows, idx, counter, _, (gather, proposal) = _verify_rows(
        drafts, np.arange(N, dtype=np.int64), logits_idx, s_counter,
        np.zeros(0, dtype=np.int64), input_ids)
    assert idx.tolist()[:4] == [0, 1, 2, 3] and counter.tolist()[:4] == [4, 5, 4, 5]
    assert proposal[:2].tolist() == [[X, -1], [X, -1]]
    keys = torch.tensor([stream_key(9, int(r)) for r in rows])
    md = SamplingMetadata(
        temperature=torch.full((2 * N,), temperature), all_greedy=temperature == 0,
        top_k=None, top_p=torch.full((2 * N,), top_p) if top_p < 1 else None, min_p=None,
        rng_key=keys, rng_counter=torch.from_numpy(counter), penalties=None,
        max_num_logprobs=None, token_bitmask=None, max_top_k=None)
    sampled = Sampler()(BASE.expand(2 * N, 8).contiguous(), md).token_ids
    accepted = num_accepted(sampled, torch.from_numpy(gather), torch.from_numpy(proposal))
    tokens = sampled.numpy().reshape(N, 2)
    acc = accepted.numpy().astype(bool)
    return tokens[:, 0], acc, np.where(acc, tokens[:, 1], -1)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_accepted_and_resampled_tokens_follow_the_target(top_p: float) -> None:
    p = oracle(BASE.numpy(), 1.0, top_p=top_p)
    first, acc, second = _verify(1.0, top_p)
    # an accepted proposal is x; a rejected one emits the target's own draw, never x
    assert (first[acc] == X).all() and (first[~acc] != X).all()
    stat, df = chi2(np.bincount(first, minlength=8), p)
    assert stat < chi2_bound(df), (stat, df)
    # acceptance rate p(x): within 4 standard deviations
    assert abs(acc.mean() - p[X]) < 4 * np.sqrt(p[X] * (1 - p[X]) / N)
    stat, df = chi2(np.bincount(second[acc], minlength=8), p)
    assert stat < chi2_bound(df), (stat, df)
    # the bound rejects a plausible bug: emitting x whenever the draw lands on x or token 0
    wrong = p.copy()
    wrong[X] += wrong[0]
    wrong[0] = 0
    wrong_first = np.where(first == 0, X, first)
    stat, df = chi2(np.bincount(wrong_first, minlength=8), p)
    assert stat > chi2_bound(df)


def test_greedy_rows_accept_exactly_the_argmax() -> None:
    first, acc, _ = _verify(0.0, 1.0)
    assert not acc.any() and (first == 0).all()  # argmax is token 0, the proposal 1
