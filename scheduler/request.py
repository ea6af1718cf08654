"""Requests, their sequences, the one state machine both follow, and the check that a new
request could ever be scheduled (`check_prompt`).

    WAITING ──admit──▶ RUNNING ──stop/length──▶ FINISHED_STOPPED / FINISHED_LENGTH
       │                │  ▲
       │         preempt│  │resume
       │                ▼  │
       │      SWAPPED (KV on CPU) ──can never swap in while idle──▶ PREEMPTED
       │      PREEMPTED (KV freed; recompute prompt + outputs on resume)
       └── any non-finished state ──abort──▶ FINISHED_ABORTED

A request's status is its live sequences' status; a sequence finishes on its own (one of n
samples may stop before the others) and the request finishes with its last sequence.
Every status change goes through `Request.move` or `Request.finish_seq`, which check it
against `_TRANSITIONS`.
"""

from __future__ import annotations

import enum

from scheduler.config import SchedulerConfig
from scheduler.sampling_params import PoolingSamplingParams, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted, KV on CPU
    PREEMPTED = "preempted"  # preempted, KV freed: recomputed when resumed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """vLLM's finish_reason string ("stop", "length", "abort") or None while live."""
        return self.value if self in _FINISHED else None


RequestStatus = SequenceStatus

_S = SequenceStatus
# A tuple, not a set: membership then compares by identity instead of calling Enum.__hash__,
# which is Python code (this is on the per-token path).
_FINISHED = (_S.FINISHED_STOPPED, _S.FINISHED_LENGTH, _S.FINISHED_ABORTED)
_TRANSITIONS: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.FINISHED_ABORTED}),
    _S.RUNNING: frozenset({_S.SWAPPED, _S.PREEMPTED, *_FINISHED}),
    # A preempted sequence still finishes by the token it sampled in a step that was in
    # flight when it was preempted (async scheduling).
    _S.SWAPPED: frozenset({_S.RUNNING, _S.PREEMPTED, *_FINISHED}),
    _S.PREEMPTED: frozenset({_S.RUNNING, *_FINISHED}),
    _S.FINISHED_STOPPED: frozenset(),
    _S.FINISHED_LENGTH: frozenset(),
    _S.FINISHED_ABORTED: frozenset(),
}


def _check_transition(what: str, old: SequenceStatus, new: SequenceStatus) -> None:
    if new not in _TRANSITIONS[old]:
        raise RuntimeError(f"{what}: illegal transition {old.name} -> {new.name}")


class Seq:
    """One of a request's n samples: its tokens and how far its KV has been computed.

    Invariants: token_ids[:prompt_len] is the prompt; while the sequence holds GPU blocks,
    num_computed == KVCacheManager.num_slots(seq_id) (slots are reserved for the tokens being
    computed in the current step, so this counts them as computed); while it runs,
    num_computed >= len(token_ids) means its next token is still being sampled by a plan in
    flight (num_computed == len(token_ids) + 1: two plans, async scheduling); `on_worker` is True
    exactly when the workers hold state for seq_id (a NewSeq was sent and no drop since).
    """

    __slots__ = ("seq_id", "index", "token_ids", "prompt_len", "num_computed", "status",
                 "on_worker", "stop_reason", "max_len", "spec_drafted", "spec_accepted")

    def __init__(self, seq_id: int, index: int, token_ids: list[int], prompt_len: int,
                 status: SequenceStatus) -> None:
        self.seq_id = seq_id
        self.index = index
        self.token_ids = token_ids
        self.prompt_len = prompt_len
        self.num_computed = 0
        self.status = status
        self.on_worker = False
        # the stop token id or stop string that finished it (None: EOS, length, abort)
        self.stop_reason: str | int | None = None
        # len(token_ids) at which it finishes with "length": prompt_len + the request's
        # max_output (set by the Scheduler once the Request exists)
        self.max_len = prompt_len + 1
        # speculative decoding: tokens proposed for it and accepted (its off switch)
        self.spec_drafted = 0
        self.spec_accepted = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    def __repr__(self) -> str:
        return (f"Seq(id={self.seq_id}, index={self.index}, len={len(self.token_ids)}, "
                f"computed={self.num_computed}, {self.status.name})")


class Request:
    """A prompt and its n sequences.

    Before its prompt is computed a request with n > 1 has only its parent sequence (index 0);
    `forked` turns True when the n - 1 children are forked from it (see Scheduler).
    """

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "n", "arrival_time",
                 "extra_key", "seqs", "status", "forked", "num_cached_tokens", "scheduled_step",
                 "admitted", "stop_token_ids", "max_output", "block_hashes", "in_lane",
                 "lora_id", "lora_slot")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, arrival_time: float,
                 extra_key: bytes | None, parent: Seq, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        sp = sampling_params
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sp
        self.n = sp.n
        self.arrival_time = arrival_time
        self.extra_key = extra_key
        # The prompt's chained full-block hashes (kvcache.hashing.prompt_block_hashes), set on
        # arrival when prefix caching is on, so no scheduling step ever hashes the prompt.
        self.block_hashes: list[bytes] = []
        self.seqs: list[Seq] = [parent]
        self.status = SequenceStatus.WAITING
        self.forked = sp.n == 1
        self.num_cached_tokens = 0
        self.scheduled_step = -1  # step_id of the last plan that computed any of its tokens
        self.admitted = False  # first admission done (prompt tokens counted, cache hit recorded)
        # EOS and stop_token_ids both stop with "stop"; EOS reports no stop_reason.
        eos = frozenset() if sp.ignore_eos else eos_token_ids
        self.stop_token_ids: dict[int, int | None] = {t: None for t in eos}
        self.stop_token_ids.update({t: t for t in sp.stop_token_ids})
        # A sequence stops at max_tokens outputs or at max_model_len tokens in all.
        limit = max_model_len - len(prompt_token_ids)
        self.max_output = limit if sp.max_tokens is None else min(sp.max_tokens, limit)
        self.in_lane = False  # a member of the Scheduler's DecodeLane
        # LoRA (scheduler/lora.py): its adapter's lora_int_id (0: the base model) and, while it
        # runs, that adapter's device slot (-1: none)
        self.lora_id = 0
        self.lora_slot = -1

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def live_seqs(self) -> list[Seq]:
        return [s for s in self.seqs if s.status not in _FINISHED]

    def target_len(self, seq: Seq) -> int:
        """Tokens the sequence must have computed before it can sample.

        An unforked parent stops one short of its prompt: its last prompt token is computed
        by each of the n sequences after the fork, so each samples its own first token.
        """
        return len(seq.token_ids) if self.forked else seq.prompt_len - 1

    def move(self, new: SequenceStatus) -> None:
        """Move the request and its live sequences to `new` (not a finished status but abort)."""
        _check_transition(f"request {self.request_id!r}", self.status, new)
        self.status = new
        for seq in self.seqs:
            if seq.status not in _FINISHED:
                _check_transition(f"seq {seq.seq_id}", seq.status, new)
                seq.status = new

    def finish_seq(self, seq: Seq, new: SequenceStatus) -> bool:
        """Finish one sequence; the request finishes (with `new`) when it was the last live one.

        Returns whether the request finished.
        """
        if new not in _FINISHED:
            raise RuntimeError(f"finish_seq needs a finished status, got {new.name}")
        _check_transition(f"seq {seq.seq_id}", seq.status, new)
        seq.status = new
        if all(s.status in _FINISHED for s in self.seqs):
            _check_transition(f"request {self.request_id!r}", self.status, new)
            self.status = new
            return True
        return False

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.name}, seqs={self.seqs})"


def check_prompt(request_id: str, prompt: list[int], sp: SamplingParams,
                 config: SchedulerConfig, num_gpu_blocks: int, block_size: int,
                 vocab_size: int | None) -> None:
    """Raise ValueError, naming the fix, for a request that could never be scheduled."""
    if not prompt:
        raise ValueError(f"request {request_id!r}: prompt_token_ids is empty; "
                         "a request needs at least one prompt token")
    if min(prompt) < 0 or (vocab_size is not None and max(prompt) >= vocab_size):
        raise ValueError(f"request {request_id!r}: prompt token ids must be in "
                         f"[0, {vocab_size if vocab_size is not None else 'vocab size'}); got "
                         f"min {min(prompt)}, max {max(prompt)}")
    max_len = config.max_model_len
    if len(prompt) > sp.max_prompt_len(max_len):
        raise ValueError(f"request {request_id!r}: prompt has {len(prompt)} tokens; "
                         f"max_model_len is {max_len} (a generation request's prompt must be "
                         "shorter to leave room for output; a pooling request's may fill it)")
    if sp.n > config.max_num_seqs:
        raise ValueError(f"request {request_id!r}: n={sp.n} exceeds max_num_seqs="
                         f"{config.max_num_seqs}")
    need = min_blocks(len(prompt), sp.n, block_size)
    if need > num_gpu_blocks:
        raise ValueError(
            f"request {request_id!r}: a prompt of {len(prompt)} tokens with n={sp.n} needs "
            f"{need} KV blocks of {block_size} tokens, but the GPU cache has only "
            f"{num_gpu_blocks}; shorten the prompt, lower n, or give the cache more memory")


def check_prompt_fits(n: int, sp: SamplingParams, max_model_len: int) -> None:
    """ValueError unless a prompt of `n` tokens and `sp.max_tokens` fit max_model_len (the
    engine's check before a request reaches the scheduler): a generation request's prompt
    leaves room for at least one output token, and for all of max_tokens; a pooling request's
    (PoolingSamplingParams: its one output is a placeholder) may fill max_model_len."""
    if isinstance(sp, PoolingSamplingParams):
        if n > max_model_len:
            raise ValueError(f"the input has {n} tokens; max_model_len is {max_model_len}")
        return
    if n >= max_model_len:
        raise ValueError(f"the prompt has {n} tokens; max_model_len is {max_model_len}, "
                         "and at least one token must be generated")
    if sp.max_tokens is not None and n + sp.max_tokens > max_model_len:
        raise ValueError(f"prompt ({n} tokens) + max_tokens ({sp.max_tokens}) = "
                         f"{n + sp.max_tokens} exceeds max_model_len ({max_model_len}); "
                         "shorten the prompt or lower max_tokens")


def check_resumable(req: Request, outputs: list[int], vocab_size: int | None) -> None:
    """Raise ValueError for tokens a resumed request (Scheduler.add_request's
    output_token_ids) cannot go on from: with n > 1, out of the vocabulary, or already at its
    length limit (such a request finished before it could be resumed)."""
    rid = req.request_id
    if req.n != 1:
        raise ValueError(f"request {rid!r}: only a request with n=1 can be resumed with the "
                         f"tokens it generated; this one has n={req.n}")
    if min(outputs) < 0 or (vocab_size is not None and max(outputs) >= vocab_size):
        raise ValueError(f"request {rid!r}: resumed output token ids must be in "
                         f"[0, {vocab_size if vocab_size is not None else 'vocab size'}); got "
                         f"min {min(outputs)}, max {max(outputs)}")
    if len(outputs) >= req.max_output:
        raise ValueError(f"request {rid!r}: resumed with {len(outputs)} output tokens, but it "
                         f"may generate at most {req.max_output}: it has finished already")


def min_blocks(num_prompt: int, n: int, block_size: int) -> int:
    """Blocks a request needs to sample its first tokens: the prompt but its last token,
    then that token once per sequence (in the shared last block, copied per child, or in
    a new block each when the shared part ends on a block boundary)."""
    shared = num_prompt - 1
    return -(-shared // block_size) + (n if shared % block_size == 0 else n - 1)
