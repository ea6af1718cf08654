"""N-gram prompt lookup: speculative decoding's proposer that needs no model.

`NgramProposer.propose(token_ids, k)` looks for the sequence's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) earlier in its own tokens (prompt and output)
and proposes the up-to-k tokens that followed the latest such earlier occurrence (the
latest one followed by k tokens, if any). It is
vLLM's `method: ngram` (prompt lookup decoding): a deterministic proposal, so to rejection
sampling its draft distribution is a point mass (workers/rejection_sampler.py).
Cost: O(len(token_ids)) numpy work per call, in the scheduler process.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposals from the sequence's own history (see the module docstring)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k proposed next tokens ([] when no n-gram of the tail recurs)."""
        num = len(token_ids)
        if k <= 0 or num <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            tail = tokens[num - n:]
            # windows[i] == tokens[i:i+n] for the starts i whose match is followed by a token
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:num - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                # the latest occurrence with k tokens after it, else the one with the most
                full = hits[hits + n + k <= num]
                start = int(full[-1] if full.size else hits[0]) + n
                return tokens[start:start + k].tolist()
        return []
