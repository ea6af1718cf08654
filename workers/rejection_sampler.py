"""Speculative decoding's acceptance (Leviathan et al. 2023; Chen et al. 2023), beside the sampler.

A verify row holds the sequence's last token and d proposed tokens x_1..x_d; the target's
logits at its d + 1 positions give, at each position j, the processed distribution p_j
(temperature, top-k/p, min-p, logit bias, penalties, bitmask: the Sampler's whole pipeline).
Rejection sampling accepts x_j with probability min(1, p_j(x_j) / q_j(x_j)), stops at the
first rejection and there draws from the residual norm(max(0, p_j - q_j)); with every x
accepted it draws the bonus token from p_{d+1}. Each emitted token is then distributed
exactly as p: P(x) = min(p, q)(x) + (1 - sum min(p, q)) * residual(x) = p(x).

Both proposers here are deterministic (n-gram lookup; a draft model decoding greedily), so
q_j is a point mass at x_j: acceptance probability p_j(x_j), residual p_j with x_j removed.
Sampling y_j ~ p_j and accepting while y_j == x_j realizes exactly that (P(accept) =
p_j(x_j); on rejection y_j is p_j conditioned on y_j != x_j), and the emitted tokens are
y_1..y_{a+1}. So the worker samples every position of a verify row through the Sampler,
each with the random stream of its own output index (a seeded request draws the very tokens
it draws with speculation off), and this module counts the agreeing prefix:
  - greedy rows: y_j is the argmax, so the run is the longest prefix equal to the target's
    greedy tokens, plus the target's next token;
  - random rows: y_j is a draw from p_j, as above.
Both are one batched comparison (no per-row branch, no host sync). Logprobs are the target's
(the Sampler's, per position).
"""

from __future__ import annotations

import torch
from torch import Tensor


def num_accepted(sampled: Tensor, gather: Tensor, drafts: Tensor) -> Tensor:
    """Accepted proposals per sampled row: int32 [S].

    `sampled` int64 [R]: the Sampler's token at every sampled position (R = sum(d_i + 1));
    `gather` int64 [S, K + 1]: row i's positions in `sampled` (padding repeats its last);
    `drafts` int64 [S, K + 1]: row i's proposals, -1 from column d_i on (never agrees).
    """
    agree = sampled[gather] == drafts
    return torch.cumprod(agree.to(torch.int32), dim=1).sum(dim=1, dtype=torch.int32)
