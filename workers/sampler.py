"""Token sampling for a batch of rows at once, with vLLM's processing order.

Per row: grammar bitmask (structured outputs) -> logit bias -> penalties (repetition on
prompt + output tokens, frequency and presence on output tokens) -> greedy argmax for
temperature 0 -> temperature -> top-k -> top-p -> min-p -> one draw from the remaining
distribution.
The three masks each keep a prefix of the values in descending order, so together they are
one per-row logit cut (`mask_threshold`), found by ordering only the largest `max_top_k`
values when every random row has a top_k, and applied in one pass.
Logprobs are `log_softmax` of the logits after the bitmask, penalties and temperature
(temperature 1 for greedy rows), before the top-k/top-p/min-p masks.
Prompt logprobs (`token_logprobs`, called per prefill chunk by workers/prompt_logprobs.py) are
the raw `log_softmax` of the logits, as vLLM reports them.

Randomness is counter-based: row r's draw is one uniform number, a hash of the row's stream
key and its counter (`rng_key`, `rng_counter`: the sample's key and how many tokens it has
generated). The key of a seeded sample is `stream_key(seed, seq_index)`; the model runner
keys an unseeded one from the engine seed and its sequence id. So a token depends only on
(key, counter, its own logits): not on the rows around it, the batch order, async
scheduling, or a preemption in between; and there is no generator state, no per-row call.
The draw is an inverse-CDF lookup (exact, unlike a race of noisy maxima it needs one random
number per row): `kernels.ops.sample_tokens` (a Triton kernel on CUDA that reads the logits
once, its torch twin on CPU) sums the rows' probabilities in chunks, finds the chunk the
uniform falls in from a float64 running sum of the chunk sums, then the token inside it.
Nothing syncs with the host, so `sample_simple` (greedy and temperature only) runs inside the
decode CUDA graph.

A step whose rows are all greedy with nothing else to apply (no bitmask, penalties, logit bias
or logprobs) needs only each row's argmax, so with tensor parallelism no rank sends its logits:
each takes its vocabulary shard's first maximum, and the output rank gets a `[rows, 2]` pair per
rank (`greedy_over_shards`), the same token `row_argmax` of the gathered logits gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kernels import ops
from workers.distributed import TensorParallelGroup

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def stream_key(seed: int, seq_index: int) -> int:
    """63-bit key of a sample's random stream (splitmix64 of the seed and the sample index)."""
    x = (seed * _GOLDEN + (seq_index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


@dataclass(slots=True)
class PenaltyInputs:
    """The penalized rows of a step and what they have seen."""

    rows: Tensor  # int64 [P] batch rows that use any penalty
    output_counts: Tensor  # float32 [P, V] occurrences of each token in the row's output so far
    prompt_mask: Tensor  # bool [P, V] token occurs in the prompt
    repetition_penalty: Tensor  # float32 [P]
    frequency_penalty: Tensor  # float32 [P]
    presence_penalty: Tensor  # float32 [P]
    logit_bias: Tensor | None = None  # float32 [P, V] added first (zeros: no bias)


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row settings of one step's sampled rows (S rows, batch order), device tensors;
    an optional field is None when no row of the step uses it."""

    temperature: Tensor  # float32 [S]; 0.0 marks a greedy row
    all_greedy: bool  # every row greedy: argmax only, no draw at all
    top_k: Tensor | None  # int32 [S]; 0 where off
    top_p: Tensor | None  # float32 [S]; 1.0 where off
    min_p: Tensor | None  # float32 [S]; 0.0 where off
    rng_key: Tensor  # int64 [S] the row's stream key
    rng_counter: Tensor  # int64 [S] tokens the row generated before this one
    penalties: PenaltyInputs | None
    max_num_logprobs: int | None  # None: no row asked for logprobs
    # int32 [S, ceil(V/32)]: bit j % 32 of word j // 32 set = token j allowed (xgrammar's
    # layout), all ones on rows without a grammar; None: no row is constrained
    token_bitmask: Tensor | None = None
    # The largest top_k of the rows that sample at random, when every one of them has a top_k
    # (the masks then order only that many values per row); None: some row samples from the
    # whole vocabulary, or no row uses top_k
    max_top_k: int | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: Tensor  # int64 [S], on the logits' device
    logprobs: Tensor | None  # float32 [S]
    top_token_ids: Tensor | None  # int64 [S, K]
    top_logprobs: Tensor | None  # float32 [S, K]


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities of given tokens (prompt logprobs), device tensors."""

    logprobs: Tensor  # float32 [M] the token's
    ranks: Tensor  # int64 [M] its rank (1: the most likely)
    top_token_ids: Tensor  # int64 [M, K]
    top_logprobs: Tensor  # float32 [M, K]


# Float32 logits that token_logprobs reads per block of rows on a CPU (one row at a 152k
# vocabulary): with its temporaries a block stays in a core's L2, so the passes after the
# first read cache, not memory. On a GPU one block is the whole slice (each pass one kernel
# over every row). docs/benchmarks.md, "Prompt logprobs", has what each choice saved.
CPU_LOGPROB_BLOCK_BYTES = 1 << 20
# Columns per segment of top1's two-level argmax (a divisor of the vocabulary: gcd with it)
_TOP1_SEGMENT = 128


def token_logprobs(logits: Tensor, targets: Tensor, k: int) -> TokenLogprobs:
    """The raw distribution's view of `targets` (int64 [M]) under `logits` `[M, V]` (any float
    dtype, left unchanged): each one's log-softmax value and rank, and the top k ids and values
    (prompt logprobs). log_softmax is logits - logsumexp, with the top value as the shift: it
    is never materialized, only the values read, in float32 blocks of rows."""
    m, vocab = logits.shape
    block = m if logits.is_cuda else max(1, CPU_LOGPROB_BLOCK_BYTES // (4 * vocab))
    parts = []
    for lo in range(0, m, block):
        x = logits[lo:lo + block].to(torch.float32)
        top, top_ids = top1(x) if k <= 1 else x.topk(k, dim=1)
        shift = top[:, :1]
        chosen = x.gather(1, targets[lo:lo + block].unsqueeze(1))
        # rank - 1: the values above the token's, counted as a float32 sum of 0/1 (exact below
        # 2^24 columns; a third of a bool tensor's int32 sum on a CPU)
        ranks = (x - chosen).gt_(0).sum(dim=1).to(torch.int64) + 1
        lse = shift + torch.exp(x - shift).sum(dim=1, keepdim=True).log_()
        parts.append(((chosen - lse).squeeze(1), ranks, top_ids[:, :k], (top - lse)[:, :k]))
    return TokenLogprobs(*(torch.cat(column) for column in zip(*parts)))


def top1(x: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's largest value and its first column, `[R, 1]` each, as `x.max(dim=1)` gives
    them, by a two-level argmax: the segments' maxima (amax: vectorized, where max with its
    index and argmax are not, ~4x faster on a CPU), then the argmax inside the first segment
    holding the row's maximum."""
    rows, vocab = x.shape
    seg = math.gcd(vocab, _TOP1_SEGMENT)
    segments = x.reshape(rows, vocab // seg, seg)
    top, which = segments.amax(dim=2).max(dim=1, keepdim=True)
    inner = segments[torch.arange(rows, device=x.device), which.squeeze(1)].argmax(dim=1,
                                                                                  keepdim=True)
    return top, which * seg + inner


def apply_penalties(logits: Tensor, output_counts: Tensor, prompt_mask: Tensor,
                    repetition_penalty: Tensor, frequency_penalty: Tensor,
                    presence_penalty: Tensor, logit_bias: Tensor | None = None) -> Tensor:
    """vLLM's logit bias, then its penalties, on float32 logits `[P, V]` (a new tensor)."""
    if logit_bias is not None:
        logits = logits + logit_bias
    output_mask = output_counts > 0
    rep = torch.where(prompt_mask | output_mask, repetition_penalty.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency_penalty.unsqueeze(1) * output_counts
    return logits - presence_penalty.unsqueeze(1) * output_mask.to(logits.dtype)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """Tokens whose bit is 0 in `bitmask` (int32 [S, ceil(V/32)]) -> -inf, in place."""
    vocab = logits.shape[1]
    if logits.is_cuda or logits.dtype != torch.float32:
        ids = torch.arange(vocab, device=logits.device)
        banned = ((bitmask[:, ids >> 5] >> (ids & 31)) & 1) == 0
        return logits.masked_fill_(banned, float("-inf"))
    # On a CPU, in numpy: unpack the bits in C, then subtract 3e38 twice from the banned
    # logits (the second overflows to -inf; the others lose 0, exactly). torch's gathers and
    # masked_fill take ~4x longer (bench/structured_bench.py), more than a small model's
    # forward pass.
    banned = np.unpackbits(np.invert(bitmask.numpy()).view(np.uint8), axis=1, count=vocab,
                           bitorder="little")
    bias = banned.astype(np.float32)
    bias *= np.float32(3e38)
    out = logits.numpy()
    with np.errstate(over="ignore"):
        out -= bias
        out -= bias
    return logits


def mask_threshold(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None,
                   min_p: Tensor | None, max_top_k: int | None = None) -> Tensor | None:
    """Each row's cut `[S, 1]` for vLLM's masks, in its order: keep every logit >= the k-th
    largest (k = 0 keeps all); then the smallest set of highest-probability tokens whose mass
    reaches top_p (at least one token); then the tokens whose probability is at least min_p
    times the top one's. Every mask keeps a prefix of the values in descending order, so their
    result is one threshold, and the tokens tied with the last one kept are kept. None: no
    mask.

    Only the largest values need ordering: the `max_top_k` largest when every row has a top_k
    of at most that (the model runner says so from the host's copy of the settings; a partial
    selection, not a sort of the vocabulary), else all of them. Tokens tied with the k-th value
    beyond that width count in top_p's normalizer (by their number: they all hold the same
    probability). min_p needs no ordering: the top probability is the largest logit's, kept by
    the masks before it, so its cut is that logit + log(min_p).
    """
    threshold = None
    if top_k is not None or top_p is not None:
        vocab = logits.shape[1]
        if max_top_k is not None and 0 < max_top_k < vocab:
            width = max_top_k
            values = logits.topk(width, dim=-1).values  # descending
        else:
            width = vocab
            values = logits.sort(dim=-1, descending=True).values
        if top_k is None:
            threshold = values[:, width - 1:]
        else:
            k = torch.where(top_k > 0, top_k.to(torch.int64), width).clamp_(max=width)
            threshold = values.gather(1, (k - 1).unsqueeze(1))
        if top_p is not None:
            kth = threshold
            weight = (values - values[:, :1]).exp_().masked_fill_(values < kth, 0.0)
            total = weight.sum(dim=1, keepdim=True)
            if width < vocab:  # ties of the k-th value beyond the width
                hidden = (logits == kth).sum(dim=1, keepdim=True) - (values == kth).sum(
                    dim=1, keepdim=True)
                total = total + hidden * (kth - values[:, :1]).exp()
            above = weight.cumsum(dim=1).sub_(weight)  # mass strictly above each position
            kept = ((above < top_p.unsqueeze(1) * total) & (values >= kth)).sum(
                dim=1, keepdim=True)
            threshold = values.gather(1, (kept - 1).clamp_(min=0))
        top = values[:, :1]
    if min_p is not None:
        if threshold is None:
            top = logits.amax(dim=-1, keepdim=True)
        cut = top + min_p.unsqueeze(1).log()  # min_p 0: -inf, no cut
        threshold = cut if threshold is None else torch.maximum(threshold, cut)
    return threshold


def apply_masks(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None,
                min_p: Tensor | None, max_top_k: int | None = None) -> Tensor:
    """`logits` with the tokens `mask_threshold` cuts at -inf (a new tensor; the same one when
    no mask applies). Kept logits are unchanged, not renormalised."""
    threshold = mask_threshold(logits, top_k, top_p, min_p, max_top_k)
    if threshold is None:
        return logits
    return logits.masked_fill(logits < threshold, float("-inf"))


# Chunk width of the two-level argmax below.
_ARGMAX_CHUNK = 256
# CPU logits whose argmax numpy takes (its argmax is vectorized; bfloat16 is not a numpy dtype)
_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


def row_argmax(x: Tensor) -> Tensor:
    """`x.argmax(dim=-1)` of a `[S, V]` tensor, the same indices (first maximum wins), faster.

    torch's CPU argmax runs a scalar loop per row, whatever the width (a batch of short rows
    pays it per row as much as one 152k-vocabulary row does). On a CPU, numpy's argmax is one
    vectorized pass per row (`torch.from_numpy` wraps its result, no copy); for bfloat16, a
    vectorized max over chunks, then an argmax inside the winning chunk.
    """
    if not x.is_cuda and x.dtype in _NUMPY_FLOATS:
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    if x.is_cuda or x.shape[-1] < 4 * _ARGMAX_CHUNK:
        return x.argmax(dim=-1)
    rows, vocab = x.shape
    main = vocab - vocab % _ARGMAX_CHUNK
    chunk_max = x[:, :main].reshape(rows, -1, _ARGMAX_CHUNK).amax(dim=-1)
    best_chunk = chunk_max.argmax(dim=-1)
    cols = best_chunk[:, None] * _ARGMAX_CHUNK + torch.arange(_ARGMAX_CHUNK, device=x.device)
    best = best_chunk * _ARGMAX_CHUNK + x.gather(1, cols).argmax(dim=-1)
    if main < vocab:  # the ragged tail wins only if strictly greater (first maximum wins)
        tail_max, tail_idx = x[:, main:].max(dim=-1)
        better = tail_max > chunk_max.gather(1, best_chunk[:, None]).squeeze(1)
        best = torch.where(better, main + tail_idx, best)
    return best


def greedy_over_shards(logits: Tensor, vocab_start: int, tp: TensorParallelGroup
                       ) -> Tensor | None:
    """Greedy token ids, int64 `[S]` on tp rank 0 (None on the others), from every rank's
    `logits` `[S, V_r]` over its vocabulary shard, ids `[vocab_start, vocab_start + V_r)` (a
    collective: every rank calls it). Exactly `row_argmax` of the concatenated shards: each
    rank takes its first maximum, rank 0 the first rank holding the largest of those values;
    ranks hold increasing ids, so among tied values that is the lowest id, as argmax's first
    maximum. Value and id travel as float64 (an fp32 value and an id < 2^53: both exact)."""
    ids = row_argmax(logits)
    if tp.world_size == 1:
        return ids
    ids = ids.to(logits.device)
    pair = torch.stack([logits.gather(1, ids.unsqueeze(1)).squeeze(1).to(torch.float64),
                        (ids + vocab_start).to(torch.float64)], dim=1)
    parts = tp.gather_last_dim(pair)
    if parts is None:
        return None
    parts = parts.view(-1, tp.world_size, 2)
    best = parts[:, :, 0].argmax(dim=1, keepdim=True)  # (torch's argmax: the first maximum)
    return parts[:, :, 1].gather(1, best).squeeze(1).to(torch.int64)


def sample_simple(logits: Tensor, temperature: Tensor, rng_key: Tensor,
                  rng_counter: Tensor) -> Tensor:
    """Greedy and temperature-only rows: int64 [S] token ids. No host sync and no shapes that
    depend on values, so it can be captured in a CUDA graph; `Sampler` uses it for such rows."""
    return ops.sample_tokens(logits, rng_key, rng_counter, temperature)


class Sampler:
    """Samples one token per row of `logits` `[S, V]` according to a `SamplingMetadata`."""

    def __call__(self, logits: Tensor, md: SamplingMetadata) -> SamplerOutput:
        processed = (md.token_bitmask is not None or md.penalties is not None
                     or md.max_num_logprobs is not None
                     or md.top_k is not None or md.top_p is not None or md.min_p is not None)
        if not processed:
            if md.all_greedy:
                return SamplerOutput(row_argmax(logits), None, None, None)
            return SamplerOutput(sample_simple(logits, md.temperature, md.rng_key,
                                               md.rng_counter), None, None, None)
        logits = logits.to(torch.float32, copy=True)
        if md.token_bitmask is not None:
            apply_token_bitmask(logits, md.token_bitmask)
        pen = md.penalties
        if pen is not None:
            logits[pen.rows] = apply_penalties(
                logits[pen.rows], pen.output_counts, pen.prompt_mask, pen.repetition_penalty,
                pen.frequency_penalty, pen.presence_penalty, pen.logit_bias)
        hot = md.temperature > 0
        if md.all_greedy:
            token_ids = row_argmax(logits)
        else:
            logits.div_(torch.where(hot, md.temperature, 1.0).unsqueeze(1))
        logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        if not md.all_greedy:
            masked = apply_masks(logits, md.top_k, md.top_p, md.min_p, md.max_top_k)
            # Greedy rows take their first maximum in the same op (temperature 0; the others'
            # logits are scaled already: 1). The masks keep every row's top value and its ties,
            # so that is the unmasked argmax, and no separate argmax pass is needed.
            token_ids = ops.sample_tokens(masked, md.rng_key, md.rng_counter,
                                          hot.to(torch.float32))
        if logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        top_lp, top_ids = logprobs.topk(md.max_num_logprobs, dim=-1)
        return SamplerOutput(token_ids, chosen, top_ids, top_lp)
