"""Sampler: exact masks on hand-built logits, penalties, logprobs, and batch-independent seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from scheduler.sampling_params import SamplingParams
from workers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    mix_seed,
)

CPU = torch.device("cpu")
NEG = float("-inf")
# Probabilities that are exact binary fractions, so cumulative sums never sit on a top_p edge.
PROBS = [0.5, 0.25, 0.125, 0.0625, 0.0625]


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _kept(masked: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(r)).flatten().tolist() for r in masked]


def test_top_k_keeps_exactly_k_largest_per_row() -> None:
    logits = _logits([[1, 5, 3, 4, 2], [1, 5, 3, 4, 2], [0.1, 0.2, 0.3, 0.4, 0.5]])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2, 5, 1]), None)
    assert _kept(out) == [[1, 3], [0, 1, 2, 3, 4], [4]]
    # Kept logits are unchanged, not renormalised.
    assert out[0].tolist() == [NEG, 5.0, NEG, 4.0, NEG]


def test_top_k_keeps_ties_with_the_kth_value() -> None:
    out = apply_top_k_top_p(_logits([[3, 1, 3, 2]]), torch.tensor([1]), None)
    assert _kept(out) == [[0, 2]]


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logp = [math.log(p) for p in PROBS]
    # Shuffled columns: the mask must follow the values, not the positions.
    order = [3, 0, 4, 1, 2]
    row = [logp[i] for i in order]
    out = apply_top_k_top_p(_logits([row, row, row, row]), None,
                            torch.tensor([0.6, 0.8, 1.0, 0.01]))
    pos = {src: col for col, src in enumerate(order)}
    assert _kept(out) == [sorted([pos[0], pos[1]]), sorted([pos[0], pos[1], pos[2]]),
                          [0, 1, 2, 3, 4], [pos[0]]]


def test_top_k_then_top_p_on_the_same_row() -> None:
    logp = [math.log(p) for p in PROBS]
    # top_k=3 leaves 0.5/0.25/0.125 (renormalised 4/7, 2/7, 1/7); top_p=0.8 then drops 1/7.
    out = apply_top_k_top_p(_logits([logp]), torch.tensor([3]), torch.tensor([0.8]))
    assert _kept(out) == [[0, 1]]


def test_min_p_masks_below_fraction_of_top_probability() -> None:
    logp = [math.log(p) for p in PROBS]
    out = apply_min_p(_logits([logp, logp, logp]), torch.tensor([0.3, 0.0, 0.2]))
    assert _kept(out) == [[0, 1], [0, 1, 2, 3, 4], [0, 1, 2]]


def test_penalties_follow_vllm() -> None:
    logits = _logits([[2.0, -1.0, 0.5, 1.0], [2.0, -1.0, 0.5, 1.0]])
    pad = 4
    prompt = torch.tensor([[0, pad], [1, 3]])
    output = torch.tensor([[2, 2], [pad, pad]])
    out = apply_penalties(logits, prompt, output, repetition_penalty=torch.tensor([2.0, 2.0]),
                          frequency_penalty=torch.tensor([0.1, 0.1]),
                          presence_penalty=torch.tensor([0.5, 0.5]))
    # Row 0: token 0 seen in prompt (2 / 2); token 2 in output twice (0.5 / 2 - 0.1 * 2 - 0.5).
    torch.testing.assert_close(out[0], torch.tensor([1.0, -1.0, 0.25 - 0.2 - 0.5, 1.0]))
    # Row 1: prompt tokens 1 (negative: * 2) and 3 (positive: / 2); no output tokens.
    torch.testing.assert_close(out[1], torch.tensor([2.0, -2.0, 0.5, 0.5]))


def _md(params: list[SamplingParams], output_indices: list[int] | None = None,
        seq_indices: list[int] | None = None, vocab: int = 1000) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, seq_indices or [0] * n, output_indices or [0] * n,
                                  [None] * n, vocab, CPU)


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 1000
    mine = torch.randn(vocab, generator=g) * 0.3  # flat: every draw is genuinely random
    others = torch.randn(5, vocab, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=1234, top_p=0.95)
    alone, batched = [], []
    for k in range(20):
        out = Sampler(CPU, seed=1)(mine[None], _md([seeded], [k]))
        alone.append(int(out.token_ids[0]))
        rows = torch.cat([others[:2], mine[None], others[2:]])
        params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, seed=9),
                  seeded, SamplingParams(temperature=0), SamplingParams(top_k=3),
                  SamplingParams(temperature=1.3, seed=77)]
        out = Sampler(CPU, seed=2 + k)(rows, _md(params, [5, 3, k, 0, 1, 2]))
        batched.append(int(out.token_ids[2]))
    assert alone == batched
    assert len(set(alone)) > 10  # really sampling, not collapsing to one token
    other_sample = [int(Sampler(CPU, 1)(mine[None], _md([seeded], [k], [1])).token_ids[0])
                    for k in range(20)]
    assert other_sample != alone  # seq_index is mixed into the seed


def test_mix_seed_is_63_bit_and_sensitive_to_each_input() -> None:
    seeds = {mix_seed(s, i, k) for s in (0, 1) for i in (0, 1) for k in (0, 1)}
    assert len(seeds) == 8 and all(0 <= s < 2 ** 63 for s in seeds)


def test_exponential_race_samples_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().expand(6000, 3).contiguous()
    out = Sampler(CPU, seed=3)(logits, _md([SamplingParams(temperature=1.0)] * 6000, vocab=3))
    freq = np.bincount(out.token_ids.numpy(), minlength=3) / 6000
    np.testing.assert_allclose(freq, probs.numpy(), atol=0.03)


def test_greedy_with_penalties_and_logprobs() -> None:
    logits = _logits([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0]])
    greedy = SamplingParams(temperature=0, logprobs=2)
    penalised = SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=0)
    md = SamplingMetadata.build([greedy, penalised], [0, 0], [0, 1],
                                [None, (np.array([3, 1], dtype=np.int64), 1)], 4, CPU)
    out = Sampler(CPU, 0)(logits, md)
    # Row 1 generated token 1 once: 3 / 2 = 1.5 < 2, so token 2 wins.
    assert out.token_ids.tolist() == [1, 2]
    expected0 = torch.log_softmax(logits[0], -1)
    expected1 = torch.log_softmax(torch.tensor([1.0, 1.5, 2.0, 0.0]), -1)
    torch.testing.assert_close(out.logprobs, torch.stack([expected0[1], expected1[2]]))
    assert out.top_token_ids.tolist() == [[1, 2], [2, 1]]
    torch.testing.assert_close(out.top_logprobs[0], expected0[[1, 2]])


def test_logprobs_are_after_temperature_before_masks() -> None:
    logits = _logits([[0.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0.5, top_k=1, logprobs=3, seed=0)
    out = Sampler(CPU, 0)(logits, _md([params], vocab=3))
    assert out.token_ids.tolist() == [2]  # top_k=1 leaves one candidate
    torch.testing.assert_close(out.top_logprobs[0], torch.log_softmax(logits[0] / 0.5, -1)[[2, 1, 0]])


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                 dict(repetition_penalty=0)])
def test_invalid_sampling_params_raise_value_error(bad) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize("vocab", [151936, 151937, 1003, 2048 + 255])
def test_row_argmax_equals_torch_argmax_including_ties(vocab: int) -> None:
    from workers.sampler import row_argmax

    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen)
    x[1, :] = 0.0  # all tied: the first index wins
    x[2, [5, vocab - 1]] = 50.0  # tie across the ragged tail: the first wins
    x[3, vocab - 1] = 60.0  # the tail alone holds the maximum
    x[4, [700, 701]] = 70.0  # tie inside one chunk
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
