"""Speculative decoding's scheduler side: its config, proposals, and applying verify results.

A decoding sequence may get proposed tokens (scheduler/ngram.py, or placeholders the
workers' draft model fills: scheduler/draft_proposer.py) and then computes them with
its last token in one verify row (StepPlan.num_draft_tokens): its slots are reserved through
KVCacheManager.allocate_slots with the proposals counted as pending (no block they fill is
hashed), the workers sample at each of the row's positions and keep the longest agreeing
prefix plus the next token (workers/rejection_sampler.py), and `apply` appends those tokens
one by one (a stop token or max_tokens inside the accepted run cuts it there), then rolls
num_computed and the KV slots back to the accepted tokens (KVCacheManager.rollback_slots:
blocks only rejected tokens filled are freed; the accepted tokens' full blocks are hashed;
the next plan replaces the workers' copy of a table that lost blocks).

Off switches: a request with penalties, a logit bias or structured outputs never speculates
(the workers' per-sequence penalty counts and grammar advance one token per step); a sequence
whose acceptance rate falls under `MIN_ACCEPTANCE` after `TRIAL_TOKENS` proposed tokens stops;
with more running sequences than `disable_by_batch_size`, nobody speculates that step (the
decode lane, which only takes one-token decodes, runs exactly then).
Async scheduling is turned off when speculation is on (the engine logs it): a verify step's
token count is only known once its result is in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scheduler.draft_proposer import DraftModelProposer
from scheduler.ngram import NgramProposer
from scheduler.outputs import StepOutcome
from scheduler.plan import StepPlan, StepResult
from scheduler.request import Request, Seq, SequenceStatus
from scheduler.step_builder import StepBuilder

MAX_SPECULATIVE_TOKENS = 16
# Above this many running sequences a step does not speculate (and the decode lane runs):
# on the 2-core CPU a verify row's k + 1 logit rows cost more than a decode's one, so only
# batch 1-2 gains (measured in docs/benchmarks.md before the LM head's CPU layout change of
# issue #26's draft session; not re-measured since); unmeasured on GPUs.
DEFAULT_DISABLE_BY_BATCH_SIZE = 2
TRIAL_TOKENS = 16  # proposed tokens a sequence gets before its acceptance rate is judged
MIN_ACCEPTANCE = 0.2  # below this accepted / proposed, the sequence stops speculating
_STOPPED = SequenceStatus.FINISHED_STOPPED
_LENGTH = SequenceStatus.FINISHED_LENGTH
_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "disable_by_batch_size"}


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's speculative_config keys: {method: ngram, num_speculative_tokens,
    prompt_lookup_min, prompt_lookup_max} (n-gram prompt lookup), {model: <checkpoint dir or
    embedded name>, num_speculative_tokens} (a draft model; method, if given, "draft_model"),
    and disable_by_batch_size (no speculation in a step with more running sequences; null:
    DEFAULT_DISABLE_BY_BATCH_SIZE). Whether the draft fits the target (vocabulary, tokenizer,
    KV layout) is checked where both are loaded (the engine, at start)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 2
    model: str | None = None  # the draft (method "draft_model")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> SpeculativeConfig:
        """Validate a speculative_config mapping; ValueError saying what to change."""
        if not isinstance(cfg, dict):
            raise ValueError(f"speculative_config must be a mapping; got {cfg!r}")
        unknown = set(cfg) - _KEYS
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {sorted(unknown)}; "
                             f"known: {sorted(_KEYS)}")
        model = cfg.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError("speculative_config.model must be the draft's checkpoint directory "
                             f"(or an embedded model's name); got {model!r}")
        method = cfg.get("method") or ("draft_model" if model is not None else "ngram")
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config.method {method!r} is unknown; the supported "
                             "methods are 'ngram' and 'draft_model' (with model: <dir>)")
        if (method == "draft_model") != (model is not None):
            raise ValueError("speculative_config.method 'draft_model' goes with model: <the "
                             "draft's checkpoint dir>, and model only with that method; got "
                             f"method {method!r}, model {model!r}")
        k = cfg.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}]; got {k!r}")
        lo, hi = cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max")
        lo = lo if lo is not None else (1 if hi is None else min(1, hi))
        hi = hi if hi is not None else max(lo, 5)
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1; got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")
        bs = cfg.get("disable_by_batch_size")
        bs = DEFAULT_DISABLE_BY_BATCH_SIZE if bs is None else bs
        if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
            raise ValueError("speculative_config.disable_by_batch_size must be an integer >= 1 "
                             f"or null (default {DEFAULT_DISABLE_BY_BATCH_SIZE}); got {bs!r}")
        return cls(method, k, lo, hi, bs, model)


class Speculator:
    """Proposals for decoding sequences, verify results applied, and vLLM's spec-decode
    counters (num_drafts, num_draft_tokens, num_accepted_tokens, accepted per position)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer: NgramProposer | DraftModelProposer = (
            DraftModelProposer() if config.model is not None
            else NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        self.shrunk: list[tuple[Request, Seq]] = []  # tables that lost blocks since the last plan

    def resend_tables(self, step: StepBuilder, kv) -> None:
        """The next plan replaces the workers' tables of sequences whose rollback freed blocks
        (still on the workers; a dropped one gets its whole table in a NewSeq anyway)."""
        for _req, seq in self.shrunk:
            if seq.on_worker and not seq.status.is_finished and kv.has_seq(seq.seq_id):
                step.replaced[seq.seq_id] = list(kv.block_table(seq.seq_id))
        self.shrunk = []

    def lane_args(self) -> tuple[int]:
        """DecodeLane's threshold: the lane's rows are one token each, so with speculation it
        runs only when the batch is too large to speculate."""
        return (self.config.disable_by_batch_size + 1,)

    def enabled_for(self, num_running_seqs: int) -> bool:
        """The per-batch off switch."""
        return num_running_seqs <= self.config.disable_by_batch_size

    def propose(self, req: Request, seq: Seq, budget: int) -> list[int]:
        """Proposed tokens for the sequence's decode this step ([]: a plain decode)."""
        sp = req.sampling_params
        if sp.uses_penalties or sp.structured_outputs is not None:
            return []
        if seq.spec_drafted >= TRIAL_TOKENS and seq.spec_accepted < MIN_ACCEPTANCE * seq.spec_drafted:
            return []
        # every token a verify row yields must fit under max_len; the row, in the budget
        k = min(self.k, seq.max_len - len(seq.token_ids) - 1, budget - 1)
        return self.proposer.propose(seq.token_ids, k) if k > 0 else []

    def apply(self, plan: StepPlan, result: StepResult, early: list, queues, kv) -> StepOutcome:
        """ResultApplier.apply for a plan with verify rows (see the module docstring)."""
        out = StepOutcome([], [], [], [], [], result, early)
        drafts = plan.num_draft_tokens[plan.do_sample].tolist()
        tokens = result.token_ids.tolist()
        counts = result.num_tokens.tolist()
        seqs_get, finish_seq = queues.seqs.get, queues.finish_seq
        row = 0
        for sid, d, n in zip(result.seq_ids.tolist(), drafts, counts):
            first, row = row, row + d + 1
            entry = seqs_get(sid)
            if entry is None:
                continue  # aborted, or finished meanwhile
            req, seq = entry
            if d:
                self._count(seq, d, n - 1)
            status = None
            for r in range(first, first + n):
                token = tokens[r]
                seq.token_ids.append(token)
                stop = req.stop_token_ids
                if token in stop and len(seq.token_ids) - seq.prompt_len > req.sampling_params.min_tokens:
                    status = _STOPPED
                    finish_seq(req, seq, status, stop[token])
                elif len(seq.token_ids) >= seq.max_len:
                    status = _LENGTH
                    finish_seq(req, seq, status)
                out.reqs.append(req)
                out.seqs.append(seq)
                out.token_ids.append(token)
                out.finished.append(status)
                out.rows.append(r)
                if status is not None:
                    break
            if d and status is None:  # (all accepted: hashes the blocks they filled)
                seq.num_computed = len(seq.token_ids) - 1
                if kv.rollback_slots(sid, seq.token_ids, seq.num_computed):
                    self.shrunk.append((req, seq))
        return out

    def _count(self, seq: Seq, drafted: int, accepted: int) -> None:
        seq.spec_drafted += drafted
        seq.spec_accepted += accepted
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        per_pos = self.accepted_per_pos
        for i in range(accepted):
            per_pos[i] += 1
