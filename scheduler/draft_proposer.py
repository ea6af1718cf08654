"""The draft-model proposer's scheduler side: proposals by reference.

A draft model (`speculative_config: {model: dir, num_speculative_tokens: k}`) runs on the
workers, beside the target and sharded like it (workers/draft_runner.py), so its tokens never
reach the scheduler before they are verified. `DraftModelProposer.propose` answers the same
call as the n-gram proposer with k `DRAFT_TOKEN` placeholders: the scheduler reserves their
slots and builds the verify row exactly as for n-gram proposals, and the workers put the
draft's greedy tokens in their place on the device, in the same step, before the target's
forward. What the scheduler learns back is the verify row's accepted tokens (StepResult), as
for any proposer.
"""

from __future__ import annotations

from scheduler.plan import DRAFT_TOKEN


class DraftModelProposer:
    """k placeholders the workers' draft model fills (see the module docstring)."""

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """k DRAFT_TOKENs (the draft always proposes: its acceptance decides, not a lookup)."""
        return [DRAFT_TOKEN] * k if k > 0 else []
