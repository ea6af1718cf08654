"""Each sampling option keeps its distribution: chi-square and KS tests against an exact target.

The targets come from a numpy oracle written from the definitions (vLLM's order: bitmask,
penalties, temperature, top-k, top-p, min-p), not from the sampler's own mask functions. Every
draw is its own (key, counter): counters vary along the draws and keys across rows, as in
serving. Keys are fixed, so each test is deterministic; its bound is the 0.1% tail of the
statistic, and each test also shows the bound rejects the distribution a plausible bug would
give (named in `wrong`), so a pass is not an artefact of a loose bound.

The first cases use one chunk of 8 tokens; the later ones vocabularies of several chunks of
`SAMPLE_CHUNK` with a ragged last one, where the draw's chunk lookup can go wrong.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kernels.reference import SAMPLE_CHUNK, uniform
from workers.sampler import PenaltyInputs, Sampler, SamplingMetadata, sample_simple, stream_key

NEG = float("-inf")
N = 20000
KEYS = 100  # rows of draw i: key stream_key(seed, i % KEYS), counter i // KEYS


def chi2_bound(df: int) -> float:
    """The 0.1% upper tail of chi-square(df) (Wilson-Hilferty; within 1% from df = 3 up)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of `counts` against probabilities `p`; tokens of probability 0
    must never be drawn (asserted)."""
    n = counts.sum()
    support = p > 0
    assert counts[~support].sum() == 0, f"drew {np.flatnonzero(counts * ~support)}, excluded"
    exp = p[support] * n
    return float(((counts[support] - exp) ** 2 / exp).sum()), int(support.sum()) - 1


def ks_bound(n: int) -> float:
    """The 0.1% critical value of the one-sample Kolmogorov-Smirnov statistic (large n)."""
    return 1.9495 / math.sqrt(n)


def ks_uniform(u: np.ndarray) -> float:
    """KS distance between the sample `u` and the uniform distribution on [0, 1)."""
    u = np.sort(u)
    n = len(u)
    return float(max((np.arange(1, n + 1) / n - u).max(), (u - np.arange(n) / n).max()))


def oracle(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0, allowed: np.ndarray | None = None,
           counts: np.ndarray | None = None, prompt: np.ndarray | None = None,
           rep: float = 1.0, freq: float = 0.0, pres: float = 0.0) -> np.ndarray:
    """The exact distribution of one row, float64, from the definitions."""
    x = logits.astype(np.float64).copy()
    if allowed is not None:
        x[~allowed] = -np.inf
    if counts is not None:
        seen = (counts > 0) | prompt
        x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * (counts > 0)
    p = np.exp(x / temperature - np.max(x / temperature))
    p /= p.sum()
    if top_k:
        p = np.where(p >= np.sort(p)[-top_k], p, 0.0)  # ties with the k-th are kept
        p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])  # mass ranked above
        keep = np.zeros_like(p, dtype=bool)
        keep[order[before < top_p]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p > 0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def metadata(n: int, seed: int, temperature: float, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0, penalties: PenaltyInputs | None = None,
             bitmask: torch.Tensor | None = None, start: int = 0) -> SamplingMetadata:
    i = torch.arange(start, start + n)
    keys = torch.tensor([stream_key(seed, k) for k in range(KEYS)])
    return SamplingMetadata(
        temperature=torch.full((n,), temperature), all_greedy=False,
        top_k=torch.full((n,), top_k, dtype=torch.int32) if top_k else None,
        top_p=torch.full((n,), top_p) if top_p < 1 else None,
        min_p=torch.full((n,), min_p) if min_p > 0 else None,
        rng_key=keys[i % KEYS], rng_counter=i // KEYS, penalties=penalties,
        max_num_logprobs=None, token_bitmask=bitmask,
        max_top_k=top_k or None)  # as the model runner sets it: every row has this top_k


def draw_counts(row: torch.Tensor, seed: int, temperature: float, n: int = N,
                **options) -> np.ndarray:
    """How often each token comes out in `n` draws of `row` through the `Sampler`."""
    vocab = row.shape[0]
    counts = np.zeros(vocab, dtype=np.int64)
    batch = 5000
    for start in range(0, n, batch):
        size = min(batch, n - start)
        logits = row.expand(size, vocab).contiguous()
        extra = {k: v(size) if callable(v) else v for k, v in options.items()}
        md = metadata(size, seed, temperature, start=start, **extra)
        counts += np.bincount(Sampler()(logits, md).token_ids.numpy(), minlength=vocab)
    return counts


def assert_fits(counts: np.ndarray, target: np.ndarray, wrong: np.ndarray) -> None:
    """`counts` fit `target`, and the same counts reject `wrong` (what a bug would draw):
    they hold a token `wrong` excludes, or its statistic passes the bound."""
    stat, df = chi2(counts, target)
    assert stat < chi2_bound(df), (stat, df)
    if counts[wrong == 0].sum() > 0:
        return
    wrong_stat, wrong_df = chi2(counts, wrong)
    assert wrong_stat > chi2_bound(wrong_df), (wrong_stat, wrong_df)


BASE = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])


@pytest.mark.parametrize(("temperature", "options", "keep"), [
    (1.0, {}, 8),
    (0.5, {}, 8),
    (2.0, {}, 8),
    (1.0, dict(top_k=3), 3),
    # probs at T=1 of the 8 logits: 0.403, 0.244, 0.148, 0.090, ...: top_p 0.6 keeps two
    (1.0, dict(top_p=0.6), 2),
    # min_p 0.3 of the top 0.403: keeps p >= 0.121, tokens 0-2
    (1.0, dict(min_p=0.3), 3),
])
def test_each_option_draws_its_distribution(temperature: float, options: dict, keep: int
                                            ) -> None:
    """Wrong: temperature twice (T != 1); k + 1 tokens kept (top_k); one token more kept
    (top_p, min_p); and at T = 1 a draw off by a few percent (6% more of token 0, 3% less of
    token 1)."""
    x = BASE.numpy()
    target = oracle(x, temperature, **options)
    assert np.flatnonzero(target).tolist() == list(range(keep))
    if temperature != 1.0:
        wrong = oracle(x, temperature ** 2, **options)
    elif options:
        wrong = np.where(np.arange(8) <= keep, oracle(x), 0.0)
        wrong /= wrong.sum()
    else:
        wrong = target * np.array([1.06, 0.97, 1, 1, 1, 1, 1, 1])
        wrong /= wrong.sum()
    counts = draw_counts(BASE, seed=keep, temperature=temperature, **options)
    assert_fits(counts, target, wrong)


def test_penalized_row_draws_the_penalized_distribution() -> None:
    """Wrong: the penalties ignored."""
    counts_out = np.array([0.0, 3, 0, 0, 0, 0, 0, 1], dtype=np.float32)
    prompt = np.array([True, False, False, False, False, False, False, False])

    def penalties(n: int) -> PenaltyInputs:
        return PenaltyInputs(torch.arange(n), torch.from_numpy(counts_out).expand(n, 8),
                             torch.from_numpy(prompt).expand(n, 8), torch.full((n,), 1.5),
                             torch.full((n,), 0.2), torch.full((n,), 0.4))

    x = BASE.numpy()
    target = oracle(x, counts=counts_out, prompt=prompt, rep=1.5, freq=0.2, pres=0.4)
    counts = draw_counts(BASE, seed=8, temperature=1.0, penalties=penalties)
    assert_fits(counts, target, oracle(x))


# A vocabulary of 7 chunks and a ragged one; the mass sits on tokens at chunk edges (first and
# last of a chunk, the ragged tail) and a few inside, everything else is -inf. A draw that
# starts a chunk one token early or late, or that picks the neighbouring chunk near a chunk
# boundary of the running sum, draws excluded tokens or the wrong shares.
VOCAB = 7 * SAMPLE_CHUNK + 57
SPOTS = [0, 1, 127, 128, 200, 255, 256, 384, 511, 640, 700, 767, 768, 895, 896, VOCAB - 1]


def spotted_row(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    row = torch.full((VOCAB,), NEG)
    row[SPOTS] = torch.randn(len(SPOTS), generator=g)
    return row


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_over_several_chunks(temperature: float) -> None:
    """Wrong: temperature applied twice (T**2); at T = 1, each token's mass one token late
    (an off-by-one inside the chunk)."""
    row = spotted_row(1)
    counts = draw_counts(row, seed=11, temperature=temperature)
    x = row.numpy()
    target = oracle(x, temperature)
    wrong = np.roll(target, 1) if temperature == 1.0 else oracle(x, temperature ** 2)
    assert_fits(counts, target, wrong)


def test_top_k_over_several_chunks() -> None:
    """Wrong: one token too many kept (off by one in k)."""
    row = spotted_row(2)
    x = row.numpy()
    counts = draw_counts(row, seed=12, temperature=1.0, top_k=5)
    assert_fits(counts, oracle(x, top_k=5), oracle(x, top_k=6))


def test_top_p_after_temperature() -> None:
    """top_p is taken on the tempered distribution. Wrong: on the untempered one (at T = 2 the
    tempered distribution is flatter, so top_p keeps more tokens)."""
    row = spotted_row(3)
    x = row.numpy()
    target = oracle(x, 2.0, top_p=0.7)
    untempered_support = oracle(x, 1.0, top_p=0.7) > 0
    wrong = np.where(untempered_support, oracle(x, 2.0), 0.0)
    assert (target > 0).sum() > untempered_support.sum()  # the case tells the orders apart
    counts = draw_counts(row, seed=13, temperature=2.0, top_p=0.7)
    assert_fits(counts, target, wrong / wrong.sum())


def test_min_p_after_temperature() -> None:
    """min_p is relative to the tempered top probability. Wrong: to the untempered one (at
    T = 0.5 the tempered distribution is sharper, so min_p keeps fewer tokens)."""
    row = spotted_row(4)
    x = row.numpy()
    target = oracle(x, 0.5, min_p=0.05)
    wide = oracle(x, 1.0, min_p=0.05) > 0
    wrong = np.where(wide, oracle(x, 0.5), 0.0)
    assert wide.sum() > (target > 0).sum()
    counts = draw_counts(row, seed=14, temperature=0.5, min_p=0.05)
    assert_fits(counts, target, wrong / wrong.sum())


def test_top_k_top_p_min_p_together() -> None:
    """vLLM's order: top-k, then top-p on what top-k left, then min-p. Wrong: top-p on the
    full distribution."""
    row = spotted_row(5)
    x = row.numpy()
    target = oracle(x, 0.8, top_k=8, top_p=0.8, min_p=0.02)
    full_top_p = oracle(x, 0.8, top_p=0.8) > 0
    wrong = np.where(full_top_p & (oracle(x, 0.8, top_k=8) > 0), oracle(x, 0.8), 0.0)
    counts = draw_counts(row, seed=15, temperature=0.8, top_k=8, top_p=0.8, min_p=0.02)
    assert_fits(counts, target, wrong / wrong.sum())


def test_penalties_before_temperature() -> None:
    """Frequency and presence penalties act on the logits before temperature. Wrong: after it
    (subtracting from logits / T)."""
    row = spotted_row(6)
    x = row.numpy()
    counts_out = np.zeros(VOCAB, dtype=np.float32)
    counts_out[[128, 511, 896]] = [1, 3, 2]
    prompt = np.zeros(VOCAB, dtype=bool)
    prompt[[0, 767]] = True
    pen = dict(counts=counts_out, prompt=prompt, rep=1.3, freq=0.3, pres=0.5)
    t = 0.5

    def penalties(n: int) -> PenaltyInputs:
        return PenaltyInputs(torch.arange(n), torch.from_numpy(counts_out).expand(n, VOCAB),
                             torch.from_numpy(prompt).expand(n, VOCAB), torch.full((n,), 1.3),
                             torch.full((n,), 0.3), torch.full((n,), 0.5))

    counts = draw_counts(row, seed=16, temperature=t, penalties=penalties)
    seen = (counts_out > 0) | prompt
    rep_only = np.where(seen, np.where(x > 0, x / 1.3, x * 1.3), x)
    late = rep_only / t - 0.3 * counts_out - 0.5 * (counts_out > 0)
    wrong = np.exp(late - late[np.isfinite(late)].max())
    assert_fits(counts, oracle(x, t, **pen), wrong / wrong.sum())


def test_bitmask_renormalises_over_allowed_tokens() -> None:
    """The grammar's bitmask excludes tokens before everything else. Wrong: masking after
    top-k (top-k would then count disallowed tokens and keep fewer allowed ones)."""
    row = spotted_row(7)
    x = row.numpy()
    allowed = np.zeros(VOCAB, dtype=bool)
    allowed[SPOTS[1::2]] = True
    words = np.zeros((VOCAB + 31) // 32, dtype=np.uint32)
    for t in np.flatnonzero(allowed):
        words[t // 32] |= np.uint32(1 << (t % 32))
    bitmask = torch.from_numpy(words.view(np.int32).copy())
    target = oracle(x, top_k=4, allowed=allowed)
    wrong = np.where(allowed, oracle(x, top_k=4), 0.0)
    assert (wrong > 0).sum() < (target > 0).sum()
    counts = draw_counts(row, seed=17, temperature=1.0, top_k=4,
                         bitmask=lambda n: bitmask.expand(n, -1))
    assert_fits(counts, target, wrong / wrong.sum())


def test_flat_vocabulary_draws_every_token_alike() -> None:
    """A flat row of 3000 tokens through `sample_simple` (the CUDA-graph path): the token ids
    are uniform (KS), and so is each chunk's share (chi-square over the 24 chunks, the last
    one ragged). Wrong: the ragged last chunk weighted as a full one."""
    vocab = 3000
    n = N
    i = torch.arange(n)
    keys = torch.tensor([stream_key(21, k) for k in range(KEYS)])[i % KEYS]
    tokens = sample_simple(torch.zeros(n, vocab), torch.ones(n), keys, i // KEYS).numpy()
    assert ks_uniform((tokens + 0.5) / vocab) < ks_bound(n)
    per_chunk = np.bincount(tokens // SAMPLE_CHUNK)
    sizes = np.minimum(SAMPLE_CHUNK, vocab - SAMPLE_CHUNK * np.arange(len(per_chunk)))
    assert sizes[-1] < SAMPLE_CHUNK
    stat, df = chi2(per_chunk, sizes / vocab)
    assert stat < chi2_bound(df)
    full = np.full(len(sizes), 1 / len(sizes))
    assert chi2(per_chunk, full)[0] > chi2_bound(df)


def test_uniform_stream_is_uniform_along_counters_and_across_keys() -> None:
    """KS on the uniforms of one key over 20000 counters, and of 20000 consecutive keys
    (stream_key(seed, i)) at one counter. Wrong: an arithmetic `>>` (negative words give
    uniforms below 0 or a skewed distribution)."""
    n = N
    key = torch.full((n,), stream_key(5, 0))
    along = uniform(key, torch.arange(n)).numpy()
    across = uniform(torch.tensor([stream_key(5, i) for i in range(n)]),
                     torch.zeros(n, dtype=torch.int64)).numpy()
    for u in (along, across):
        assert u.min() >= 0.0 and u.max() < 1.0
        assert ks_uniform(u) < ks_bound(n)
    # An arithmetic shift keeps the sign bit: uniforms of 0.5 and up would come out below 0.
    assert ks_uniform(np.where(along >= 0.5, along - 1.0, along)) > ks_bound(n)


def test_consecutive_counters_and_neighbouring_keys_are_independent() -> None:
    """Chi-square of the 10 x 10 grid of pairs: (u at counter c, u at counter c + 1) of one
    key, and (u of stream_key(s, i), u of stream_key(s, i + 1)) at one counter. Wrong: a
    counter that enters the hash weakly (pairs on the diagonal)."""
    n = N
    counters = torch.arange(n + 1)
    along = uniform(torch.full((n + 1,), stream_key(9, 3)), counters).numpy()
    across = uniform(torch.tensor([stream_key(9, i) for i in range(n + 1)]),
                     torch.full((n + 1,), 4)).numpy()
    for u in (along, across):
        cells = (np.floor(u[:-1] * 10) * 10 + np.floor(u[1:] * 10)).astype(np.int64)
        stat, df = chi2(np.bincount(cells, minlength=100), np.full(100, 0.01))
        assert stat < chi2_bound(df), stat
    weak = np.floor(along[:-1] * 10) * 11  # both halves of the pair in the same decile
    stat, df = chi2(np.bincount(weak.astype(np.int64), minlength=100), np.full(100, 0.01))
    assert stat > chi2_bound(df)
