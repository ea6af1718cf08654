"""Token sampling for a batch, vectorized over rows, with vLLM's processing order.

Per row: penalties (repetition on prompt + output tokens, frequency and presence on output
tokens) -> greedy argmax for temperature 0 -> temperature -> top-k -> top-p -> min-p ->
a draw by the exponential-race trick (argmax of probs / Exponential(1) noise, which samples
from `probs` exactly). Logprobs are `log_softmax` of the logits after penalties and
temperature (temperature 1 for greedy rows), before the top-k/top-p/min-p masks.

Seeds: a seeded row's noise comes from a generator seeded with
`mix_seed(seed, seq_index, output_index)`, so the k-th token of a seeded sample depends only
on its own logits: not on the batch around it, nor on a preemption in between.
Unseeded rows share the worker's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from scheduler.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, seq_index: int, output_index: int) -> int:
    """A 63-bit generator seed from (request seed, sample index, output token index): splitmix64."""
    x = (seed * 0x9E3779B97F4A7C15 + seq_index * 0xBF58476D1CE4E5B9
         + output_index * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


@dataclass(slots=True)
class SamplingMetadata:
    """The per-row sampling settings of one step as tensors; a field is None when no row uses it."""

    greedy: Tensor  # bool [S]
    all_greedy: bool
    temperature: Tensor  # float32 [S], 1.0 on greedy rows
    top_k: Tensor | None  # int64 [S], vocab_size where off
    top_p: Tensor | None  # float32 [S], 1.0 where off
    min_p: Tensor | None  # float32 [S], 0.0 where off
    penalty_rows: Tensor | None  # int64 [P] rows that use any penalty
    prompt_tokens: Tensor | None  # int64 [P, Lp], padded with vocab_size
    output_tokens: Tensor | None  # int64 [P, Lo], padded with vocab_size
    repetition_penalty: Tensor | None  # float32 [P]
    frequency_penalty: Tensor | None  # float32 [P]
    presence_penalty: Tensor | None  # float32 [P]
    seeded_rows: list[int]
    row_seeds: list[int]  # mix_seed(...) for each seeded row, this step
    max_num_logprobs: int | None  # None: no row asked for logprobs

    @classmethod
    def build(cls, params: list[SamplingParams], seq_indices: list[int], output_indices: list[int],
              histories: list[tuple[np.ndarray, int] | None], vocab_size: int,
              device: torch.device) -> SamplingMetadata:
        """`histories[i]` is (every token of row i so far, prompt_len) for rows with penalties.

        `output_indices[i]` is how many tokens row i has generated before this one.
        """
        greedy = [p.greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        sampled = [p for p, g in zip(params, greedy) if not g]
        top_k = top_p = min_p = None
        if any(p.top_k > 0 for p in sampled):
            top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size
                                  for p in params], dtype=torch.int64, device=device)
        if any(p.top_p < 1.0 for p in sampled):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        if any(p.min_p > 0.0 for p in sampled):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        rows = [i for i, p in enumerate(params) if p.uses_penalties]
        pen: dict[str, Tensor | None] = dict.fromkeys(
            ("penalty_rows", "prompt_tokens", "output_tokens", "repetition_penalty",
             "frequency_penalty", "presence_penalty"))
        if rows:
            prompts, outputs = [], []
            for i in rows:
                history = histories[i]
                if history is None:
                    raise ValueError(f"row {i} uses penalties but has no token history")
                tokens, prompt_len = history
                prompts.append(tokens[:prompt_len])
                outputs.append(tokens[prompt_len:])
            pen["penalty_rows"] = torch.tensor(rows, dtype=torch.int64, device=device)
            pen["prompt_tokens"] = _pad(prompts, vocab_size, device)
            pen["output_tokens"] = _pad(outputs, vocab_size, device)
            for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
                pen[name] = torch.tensor([getattr(params[i], name) for i in rows],
                                         dtype=torch.float32, device=device)
        seeded = [i for i, (p, g) in enumerate(zip(params, greedy)) if p.seed is not None and not g]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=top_k, top_p=top_p, min_p=min_p, **pen,
            seeded_rows=seeded,
            row_seeds=[mix_seed(params[i].seed, seq_indices[i], output_indices[i])  # type: ignore[arg-type]
                       for i in seeded],
            max_num_logprobs=max(asked) if asked else None,
        )


def _pad(rows: list[np.ndarray], pad: int, device: torch.device) -> Tensor:
    width = max(1, max(len(r) for r in rows))
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return torch.from_numpy(out).to(device)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: Tensor  # int64 [S]
    logprobs: Tensor | None  # float32 [S]
    top_token_ids: Tensor | None  # int64 [S, K]
    top_logprobs: Tensor | None  # float32 [S, K]


def _bin_counts(tokens: Tensor, vocab_size: int) -> Tensor:
    """Counts `[P, vocab_size]` of each token id per row; the pad id `vocab_size` is dropped."""
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: Tensor, prompt_tokens: Tensor, output_tokens: Tensor,
                    repetition_penalty: Tensor, frequency_penalty: Tensor,
                    presence_penalty: Tensor) -> Tensor:
    """vLLM's penalties on float32 logits `[P, V]` (returns a new tensor)."""
    vocab_size = logits.shape[1]
    output_counts = _bin_counts(output_tokens, vocab_size)
    output_mask = output_counts > 0
    seen = (_bin_counts(prompt_tokens, vocab_size) > 0) | output_mask
    rep = torch.where(seen, repetition_penalty.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency_penalty.unsqueeze(1) * output_counts
    return logits - presence_penalty.unsqueeze(1) * output_mask.to(logits.dtype)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """vLLM's masks: keep every logit >= the k-th largest (ties kept), then the smallest set of
    highest-probability tokens whose mass reaches top_p (at least one token). Masked -> -inf."""
    if top_k is None and top_p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = logits_sort.gather(1, (logits_sort.shape[1] - top_k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    if top_p is not None:
        probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        mask = probs_sum <= 1 - top_p.unsqueeze(1)
        mask[:, -1] = False
        logits_sort.masked_fill_(mask, float("-inf"))
    return logits_sort.scatter(1, logits_idx, logits_sort)


# Chunk width of the two-level argmax below.
_ARGMAX_CHUNK = 256


def row_argmax(x: Tensor) -> Tensor:
    """`x.argmax(dim=-1)` of a `[S, V]` tensor, the same indices (first maximum wins), faster.

    torch's CPU argmax over a 152k vocabulary runs unvectorized (15 ms for 64 rows here);
    a vectorized max over chunks, then an argmax inside the winning chunk, takes 4 ms.
    """
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


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    """Samples one token per row of `logits` `[S, V]` according to a `SamplingMetadata`."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._row_generator = torch.Generator(device=device)

    def __call__(self, logits: Tensor, md: SamplingMetadata) -> SamplerOutput:
        # The penalty write and the temperature division are in place: work on a copy then.
        in_place = md.penalty_rows is not None or not md.all_greedy
        logits = logits.to(torch.float32, copy=in_place)
        if md.penalty_rows is not None:
            logits[md.penalty_rows] = apply_penalties(
                logits[md.penalty_rows], md.prompt_tokens, md.output_tokens,
                md.repetition_penalty, md.frequency_penalty, md.presence_penalty)
        if md.all_greedy:
            token_ids = row_argmax(logits)
        else:
            greedy_ids = row_argmax(logits)
            logits.div_(md.temperature.unsqueeze(1))
        logprobs = None
        if md.max_num_logprobs is not None:
            logprobs = logits.log_softmax(dim=-1)
        if not md.all_greedy:
            masked = apply_top_k_top_p(logits, md.top_k, md.top_p)
            if md.min_p is not None:
                masked = apply_min_p(masked, md.min_p)
            probs = masked.softmax(dim=-1)
            sampled = row_argmax(probs.div_(self._exponential_noise(probs, md)))
            token_ids = torch.where(md.greedy, greedy_ids, sampled)
        if logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        top_lp, top_ids = logprobs.topk(md.max_num_logprobs, dim=-1)
        return SamplerOutput(token_ids, chosen, top_ids, top_lp)

    def _exponential_noise(self, probs: Tensor, md: SamplingMetadata) -> Tensor:
        q = torch.empty_like(probs)
        if not md.seeded_rows:
            q.exponential_(generator=self.generator)
        else:
            seeded = set(md.seeded_rows)
            others = [i for i in range(probs.shape[0]) if i not in seeded]
            if others:
                noise = torch.empty(len(others), probs.shape[1], dtype=probs.dtype,
                                    device=probs.device).exponential_(generator=self.generator)
                q[torch.tensor(others, device=probs.device)] = noise
            for row, seed in zip(md.seeded_rows, md.row_seeds):
                self._row_generator.manual_seed(seed)
                q[row].exponential_(generator=self._row_generator)
        # A zero draw would turn a masked token's 0 / 0 into NaN, which argmax would pick.
        return q.clamp_(min=torch.finfo(q.dtype).tiny)
