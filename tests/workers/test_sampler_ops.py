"""Sampler: exact masks on hand-built logits, penalties, the grammar bitmask, logprobs, the
counter-based streams (batch-independent, bit-exact with a Python reference). That every
sampling option draws from the distribution it should: test_sampler_distributions.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kernels.reference import uniform
from scheduler.sampling_params import SamplingParams
from workers.sampler import (
    PenaltyInputs,
    Sampler,
    SamplingMetadata,
    apply_masks,
    apply_penalties,
    apply_token_bitmask,
    sample_simple,
    stream_key,
)

NEG = float("-inf")
# Probabilities that are exact binary fractions, so cumulative sums never sit on a top_p edge.
PROBS = [0.5, 0.25, 0.125, 0.0625, 0.0625]


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _kept(masked: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(r)).flatten().tolist() for r in masked]


def _md(params: list[SamplingParams], counters: list[int] | None = None,
        keys: list[int] | None = None, penalties: PenaltyInputs | None = None,
        bitmask: torch.Tensor | None = None) -> SamplingMetadata:
    """The metadata the model runner builds for these rows (keys: stream_key(seed, 0))."""
    n = len(params)
    random = [not p.greedy for p in params]
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params]),
        all_greedy=not any(random),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int32)
        if any(p.top_k for p, r in zip(params, random) if r) else None,
        top_p=torch.tensor([p.top_p for p in params])
        if any(p.top_p < 1 for p, r in zip(params, random) if r) else None,
        min_p=torch.tensor([p.min_p for p in params])
        if any(p.min_p > 0 for p, r in zip(params, random) if r) else None,
        rng_key=torch.tensor(keys or [stream_key(p.seed or 0, 0) for p in params]),
        rng_counter=torch.tensor(counters or [0] * n),
        penalties=penalties, max_num_logprobs=max(asked) if asked else None,
        token_bitmask=bitmask)


def test_top_k_keeps_exactly_k_largest_per_row() -> None:
    logits = _logits([[1, 5, 3, 4, 2], [1, 5, 3, 4, 2], [0.1, 0.2, 0.3, 0.4, 0.5]])
    out = apply_masks(logits.clone(), torch.tensor([2, 0, 1]), None, None)  # 0: off
    assert _kept(out) == [[1, 3], [0, 1, 2, 3, 4], [4]]
    # Kept logits are unchanged, not renormalised.
    assert out[0].tolist() == [NEG, 5.0, NEG, 4.0, NEG]


def test_top_k_keeps_ties_with_the_kth_value() -> None:
    out = apply_masks(_logits([[3, 1, 3, 2]]), torch.tensor([1]), None, None)
    assert _kept(out) == [[0, 2]]


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logp = [math.log(p) for p in PROBS]
    # Shuffled columns: the mask must follow the values, not the positions.
    order = [3, 0, 4, 1, 2]
    row = [logp[i] for i in order]
    out = apply_masks(_logits([row, row, row, row]), None,
                      torch.tensor([0.6, 0.8, 1.0, 0.01]), None)
    pos = {src: col for col, src in enumerate(order)}
    assert _kept(out) == [sorted([pos[0], pos[1]]), sorted([pos[0], pos[1], pos[2]]),
                          [0, 1, 2, 3, 4], [pos[0]]]


def test_top_k_then_top_p_on_the_same_row() -> None:
    logp = [math.log(p) for p in PROBS]
    # top_k=3 leaves 0.5/0.25/0.125 (renormalised 4/7, 2/7, 1/7); top_p=0.8 then drops 1/7.
    out = apply_masks(_logits([logp]), torch.tensor([3]), torch.tensor([0.8]), None)
    assert _kept(out) == [[0, 1]]


def _masks_oracle(row: np.ndarray, k: int, p: float, min_p: float) -> tuple[np.ndarray, float]:
    """The definition in float64: keep values >= the k-th largest, then, in descending order,
    every token whose mass strictly above it (in the top-k set) is below p, and every token
    tied with the last one kept, then those with probability >= min_p times the top one's.
    Also the boundary's margin |mass above - p| nearest the top_p cut."""
    desc = np.sort(row.astype(np.float64))[::-1]
    kth = desc[(k or len(row)) - 1]
    weight = np.where(desc >= kth, np.exp(desc - desc[0]), 0.0)
    prob = weight / weight.sum()
    above = np.cumsum(prob) - prob
    keep = (above < p) & (desc >= kth)
    threshold = max(desc[keep.sum() - 1], desc[0] + np.log(min_p) if min_p else -np.inf)
    margin = np.abs(above[desc >= kth] - p).min() if p < 1 else 1.0
    return row >= threshold, margin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masks_ordering_max_top_k_values_keep_what_the_definition_does(dtype) -> None:
    """Rows that all have a top_k order only max_top_k values (a partial selection); the masks
    are those of the definition either way, ties included: bf16 logits tie often, and the
    tests' rows tie at the k-th value beyond max_top_k."""
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 48, 3000
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(dtype).float()
    top_k = torch.randint(1, 40, (rows,), generator=gen, dtype=torch.int32)
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.05
    top_p[::5] = 1.0
    min_p = torch.where(torch.arange(rows) % 3 == 1, 0.05, 0.0)
    # Row 0: its k-th largest (k = the max, 40) tied by 6 more values beyond the first 40.
    top_k[0] = 40
    logits[0, :100] = torch.linspace(10, 5, 100)
    logits[0, 39:46] = logits[0, 39]
    top_p[0] = 0.97  # reached only by counting the hidden ties in the normalizer
    for max_top_k in (None, int(top_k.max())):
        out = apply_masks(logits, top_k, top_p, min_p, max_top_k)
        for r in range(rows):
            want, margin = _masks_oracle(logits[r].numpy(), int(top_k[r]), float(top_p[r]),
                                         float(min_p[r]))
            if margin < 1e-5:  # the cut sits on a float32 rounding edge: either is right
                continue
            assert torch.isfinite(out[r]).numpy().tolist() == want.tolist(), (max_top_k, r)
    assert torch.isfinite(out[0]).sum() == 46  # the ties beyond the width are kept
    kept = torch.isfinite(out)
    assert torch.equal(out[kept], logits[kept])  # kept logits unchanged


def test_max_top_k_is_the_largest_top_k_of_the_random_rows() -> None:
    from workers.step_batch import max_top_k as _max_top_k

    table = SimpleNamespace(temperature=np.array([0.7, 0.0, 1.0, 0.5], dtype=np.float32),
                            top_k=np.array([20, 0, 50, 5], dtype=np.int32))
    assert _max_top_k(table, np.array([0, 1, 2, 3])) == 50  # the greedy row's 0 is no matter
    assert _max_top_k(table, np.array([0, 3])) == 20
    table.top_k[3] = 0  # a random row without top_k: its masks need every value
    assert _max_top_k(table, np.array([0, 2, 3])) is None
    assert _max_top_k(table, np.array([1])) is None


def test_min_p_masks_below_fraction_of_top_probability() -> None:
    logp = [math.log(p) for p in PROBS]
    out = apply_masks(_logits([logp, logp, logp]), None, None, torch.tensor([0.3, 0.0, 0.2]))
    assert _kept(out) == [[0, 1], [0, 1, 2, 3, 4], [0, 1, 2]]


def test_min_p_after_top_k_and_top_p() -> None:
    """The cuts combine: the strictest one wins on each row (min_p's is relative to the top
    probability, which the masks before it always keep)."""
    logp = [math.log(p) for p in PROBS]
    rows = _logits([logp, logp, logp])
    out = apply_masks(rows, torch.tensor([4, 2, 0]), torch.tensor([1.0, 1.0, 0.8]),
                      torch.tensor([0.2, 0.01, 0.3]), max_top_k=None)
    assert _kept(out) == [[0, 1, 2], [0, 1], [0, 1]]


def test_penalties_follow_vllm() -> None:
    logits = _logits([[2.0, -1.0, 0.5, 1.0], [2.0, -1.0, 0.5, 1.0]])
    counts = torch.tensor([[0.0, 0, 2, 0], [0, 0, 0, 0]])
    prompt = torch.tensor([[True, False, False, False], [False, True, False, True]])
    out = apply_penalties(logits, counts, prompt, repetition_penalty=torch.tensor([2.0, 2.0]),
                          frequency_penalty=torch.tensor([0.1, 0.1]),
                          presence_penalty=torch.tensor([0.5, 0.5]))
    # Row 0: token 0 seen in prompt (2 / 2); token 2 in output twice (0.5 / 2 - 0.1 * 2 - 0.5).
    torch.testing.assert_close(out[0], torch.tensor([1.0, -1.0, 0.25 - 0.2 - 0.5, 1.0]))
    # Row 1: prompt tokens 1 (negative: * 2) and 3 (positive: / 2); no output tokens.
    torch.testing.assert_close(out[1], torch.tensor([2.0, -2.0, 0.5, 0.5]))


def _splitmix_reference(key: int, counter: int) -> float:
    m = (1 << 64) - 1
    x = (key ^ (counter * 0x9E3779B97F4A7C15)) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    x ^= x >> 31
    return (x >> 11) * 2.0 ** -53


def test_uniform_is_bit_exact_with_unsigned_64_bit_arithmetic() -> None:
    """torch's int64 ops wrap and shift arithmetically: the stream must still be the
    unsigned splitmix64 the reference computes, on every key and counter."""
    keys = [stream_key(s, i) for s in (0, 1, 2**40 + 7, 2**62) for i in (0, 1, 5)]
    counters = [0, 1, 2, 999, 2**31 + 3]
    k = torch.tensor([a for a in keys for _ in counters])
    c = torch.tensor([b for _ in keys for b in counters])
    got = uniform(k, c).tolist()
    assert got == [_splitmix_reference(a, b) for a, b in zip(k.tolist(), c.tolist())]
    assert all(0.0 <= u < 1.0 for u in got) and len(set(got)) == len(got)


def test_stream_key_is_63_bit_and_sensitive_to_each_input() -> None:
    keys = {stream_key(s, i) for s in (0, 1, 12345) for i in (0, 1, 2)}
    assert len(keys) == 9 and all(0 <= k < 2 ** 63 for k in keys)


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 1000
    mine = torch.randn(vocab, generator=g) * 0.3  # flat: every draw is genuinely random
    others = torch.randn(5, vocab, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=1234, top_p=0.95)
    sampler = Sampler()
    alone, batched, moved = [], [], []
    for k in range(20):
        out = sampler(mine[None], _md([seeded], [k]))
        alone.append(int(out.token_ids[0]))
        rows = torch.cat([others[:2], mine[None], others[2:]])
        params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, seed=9),
                  seeded, SamplingParams(temperature=0), SamplingParams(top_k=3, logprobs=2),
                  SamplingParams(temperature=1.3, seed=77, min_p=0.1)]
        out = sampler(rows, _md(params, [5, 3, k, 0, 1, 2]))
        batched.append(int(out.token_ids[2]))
        out = sampler(torch.cat([mine[None], others]), _md([seeded] + params[:5], [k, 1, 2, 3, 4, 5]))
        moved.append(int(out.token_ids[0]))
    assert alone == batched == moved
    assert len(set(alone)) > 10  # really sampling, not collapsing to one token
    other_stream = [int(sampler(mine[None], _md([seeded], [k], [stream_key(1234, 1)]))
                        .token_ids[0]) for k in range(20)]
    assert other_stream != alone  # the sample index is in the key


@pytest.mark.parametrize("threads", [1, 2])
def test_seeded_row_alone_equals_it_among_64_others_at_any_position(threads: int) -> None:
    """At Qwen3's vocabulary, where the CPU draw works a few rows at a time (how many follows
    torch's thread count): a row's token is its own, whatever block and neighbours it gets."""
    vocab = 151936
    g = torch.Generator().manual_seed(3)
    others = torch.randn(64, vocab, generator=g) * 2
    mine = torch.randn(vocab, generator=g)
    temps = torch.rand(64, generator=g) * 1.5
    temps[::3] = 0.0  # greedy neighbours too
    keys = torch.randint(0, 2 ** 62, (64,), generator=g)
    counters = torch.randint(0, 1000, (64,), generator=g)
    key, t = stream_key(4321, 0), torch.tensor([0.9])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = [int(sample_simple(mine[None], t, torch.tensor([key]), torch.tensor([c])))
                 for c in range(3)]
        for pos in (0, 5, 37, 64):
            logits = torch.cat([others[:pos], mine[None], others[pos:]])
            temperature = torch.cat([temps[:pos], t, temps[pos:]])
            k = torch.cat([keys[:pos], torch.tensor([key]), keys[pos:]])
            for c in range(3):
                ctr = torch.cat([counters[:pos], torch.tensor([c]), counters[pos:]])
                assert int(sample_simple(logits, temperature, k, ctr)[pos]) == alone[c]
    finally:
        torch.set_num_threads(before)
    assert len(set(alone)) == 3  # three counters, three different draws from a flat row


def test_token_bitmask_masks_sampling_greedy_and_logprobs() -> None:
    vocab = 70  # three words of 32 bits, the last one partly used
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    logits[:, 5] = 50.0  # the favourite, disallowed on rows 0 and 1
    allowed = [[5 + 1, 33, 64], [2, 40], list(range(vocab))]
    mask = torch.zeros(3, 3, dtype=torch.int32)
    for r, ids in enumerate(allowed):
        for t in ids:
            word = int(mask[r, t // 32]) | (1 << (t % 32))
            mask[r, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    params = [SamplingParams(temperature=1.0, seed=1, logprobs=1),
              SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.0)]
    out = Sampler()(logits, _md(params, bitmask=mask))
    assert out.token_ids[0].item() in allowed[0]
    assert out.token_ids[1].item() == max(allowed[1], key=lambda t: logits[1, t].item())
    assert out.token_ids[2].item() == 5
    assert out.top_token_ids[0, 0].item() in allowed[0]


def test_token_bitmask_cpu_unpacking_reads_every_bit_like_the_device_formula() -> None:
    vocab = 1000  # 32 words, the last one partly used
    gen = torch.Generator().manual_seed(3)
    mask = torch.randint(-2**31, 2**31 - 1, (4, 32), dtype=torch.int32, generator=gen)
    mask[1] = -1  # all allowed
    mask[2] = 0  # none (a row never gets this; the bits must still be read right)
    logits = torch.randn(4, vocab, generator=gen) * 1e4
    words = mask.to(torch.int64) & 0xFFFFFFFF
    expected = [[x if (int(words[r, t // 32]) >> (t % 32)) & 1 else float("-inf")
                 for t, x in enumerate(logits[r].tolist())] for r in range(4)]
    assert apply_token_bitmask(logits.clone(), mask).tolist() == expected  # numpy, exact
    half = logits.to(torch.bfloat16)  # (the torch formula, as on a GPU)
    assert apply_token_bitmask(half.clone(), mask).tolist() == [
        [x if e != float("-inf") else e for x, e in zip(h, row)]
        for h, row in zip(half.tolist(), expected)]


def test_sample_simple_is_the_sampler_for_temperature_only_rows() -> None:
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=t, seed=s) for t, s in
              ((0.0, 1), (0.7, 2), (1.0, 3), (0.0, 4), (1.5, 5), (0.3, 6))]
    md = _md(params, [3, 1, 4, 1, 5, 9])
    simple = sample_simple(logits, md.temperature, md.rng_key, md.rng_counter)
    assert simple.tolist() == Sampler()(logits, md).token_ids.tolist()
    # bf16 logits (the GPU dtype) are sampled in float32 too
    assert sample_simple(logits.bfloat16(), md.temperature, md.rng_key,
                         md.rng_counter).shape == (6,)


def test_greedy_with_penalties_and_logprobs() -> None:
    logits = _logits([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0]])
    greedy = SamplingParams(temperature=0, logprobs=2)
    penalised = SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=0)
    pen = PenaltyInputs(torch.tensor([1]), torch.tensor([[0.0, 1, 0, 0]]),
                        torch.tensor([[False, False, False, True]]), torch.tensor([2.0]),
                        torch.tensor([0.0]), torch.tensor([0.0]))
    out = Sampler()(logits, _md([greedy, penalised], penalties=pen))
    # Row 1 generated token 1 once: 3 / 2 = 1.5 < 2, so token 2 wins.
    assert out.token_ids.tolist() == [1, 2]
    expected0 = torch.log_softmax(logits[0], -1)
    expected1 = torch.log_softmax(torch.tensor([1.0, 1.5, 2.0, 0.0]), -1)
    torch.testing.assert_close(out.logprobs, torch.stack([expected0[1], expected1[2]]))
    assert out.top_token_ids.tolist() == [[1, 2], [2, 1]]
    torch.testing.assert_close(out.top_logprobs[0], expected0[[1, 2]])


def test_logit_bias_is_added_before_the_penalties() -> None:
    """vLLM's order: the bias first, then the repetition penalty divides the biased logit.
    Row 0: token 1 was generated (repetition 2); +3 on token 1 -> (3 + 3) / 2 = 3 beats 2.5.
    Bias after the penalty would give 3 / 2 + 3 = 4.5, the same winner but other logprobs."""
    logits = _logits([[1.0, 3.0, 2.5, 0.0], [1.0, 3.0, 2.5, 0.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=0,
                             logit_bias={1: 3.0}),
              SamplingParams(temperature=0, logprobs=0, logit_bias={3: 100.0})]
    pen = PenaltyInputs(torch.tensor([0, 1]), torch.tensor([[0.0, 1, 0, 0], [0.0, 0, 0, 0]]),
                        torch.zeros(2, 4, dtype=torch.bool), torch.tensor([2.0, 1.0]),
                        torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.0]),
                        logit_bias=torch.tensor([[0.0, 3.0, 0, 0], [0, 0, 0, 100.0]]))
    out = Sampler()(logits, _md(params, penalties=pen))
    assert out.token_ids.tolist() == [1, 3]
    torch.testing.assert_close(out.logprobs[0], torch.log_softmax(
        torch.tensor([1.0, 3.0, 2.5, 0.0]), -1)[1])


def test_greedy_rows_beside_masked_random_rows_take_their_first_maximum() -> None:
    """A batch on the processed path (a random row with masks): its greedy rows come out of the
    same draw at temperature 0, as the first maximum of their (bitmasked) logits, whatever
    masks they carry; the bitmask bans the first of two tied maxima on row 2."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=gen)
    logits[0, [7, 250]] = 9.0  # tied maxima: the first wins
    logits[2, [11, 40]] = 9.0
    params = [SamplingParams(temperature=0, top_k=3, min_p=0.5),
              SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3),
              SamplingParams(temperature=0, top_p=0.5), SamplingParams(temperature=0)]
    bitmask = torch.full((4, 10), -1, dtype=torch.int32)
    bitmask[2, 0] = ~(1 << 11)  # token 11 banned on row 2
    md = _md(params, bitmask=bitmask)
    md.max_top_k = None
    out = Sampler()(logits.clone(), md)
    banned = logits.clone()
    banned[2, 11] = NEG
    want = [7, None, 40, int(banned[3].argmax())]
    got = out.token_ids.tolist()
    assert [g if w is not None else None for g, w in zip(got, want)] == want
    assert got[1] in logits[1].topk(5).indices.tolist()


def test_logprobs_are_after_temperature_before_masks() -> None:
    logits = _logits([[0.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0.5, top_k=1, logprobs=3, seed=0)
    out = Sampler()(logits, _md([params]))
    assert out.token_ids.tolist() == [2]  # top_k=1 leaves one candidate
    torch.testing.assert_close(out.top_logprobs[0],
                               torch.log_softmax(logits[0] / 0.5, -1)[[2, 1, 0]])


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                 dict(repetition_penalty=0)])
def test_invalid_sampling_params_raise_value_error(bad) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [151936, 151937, 1003, 2048 + 255, 64 * 16])
def test_row_argmax_equals_torch_argmax_including_ties(vocab: int, dtype: torch.dtype) -> None:
    """float32 takes numpy's argmax, bfloat16 the two-level one: the same ids as torch's."""
    from workers.sampler import row_argmax

    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen).to(dtype)
    x[1, :] = 0.0  # all tied: the first index wins
    x[2, [5, vocab - 1]] = 50.0  # tie across the ragged tail: the first wins
    x[3, vocab - 1] = 60.0  # the tail alone holds the maximum
    x[4, [700, 701]] = 70.0  # tie inside one chunk
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
