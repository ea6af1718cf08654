"""What crosses from the scheduler to the workers (StepPlan) and back (StepResult).

These are the only scheduler types the workers import. They hold plain ints, lists and
numpy arrays so a plan pickles in microseconds and no Python object exists per token.

The protocol is a diff. A worker keeps, per sequence id, its block table and the token ids
it has seen (for penalties). A sequence's state is created by a `NewSeq` entry and dropped
when its id appears in `StepPlan.dropped_seq_ids`; in between each plan only says what changed.

A worker executes a plan in this order:
  1. drop the state of `dropped_seq_ids` (finished, aborted, or preempted since last plan);
  2. `offload` pairs (GPU block -> offload-tier CPU block: evicted prefix blocks, copied
     out before anything of this step overwrites them), then `swap_out` pairs (GPU block ->
     CPU swap block), then `swap_in` pairs (CPU swap -> GPU), then `load` pairs (offload
     tier -> GPU: prefix blocks found in the tier, read by this step; a load may read a
     tier block that an offload of this same step wrote), then `copies` (GPU src -> GPU
     dst, copy-on-write), every layer, K and V, each rank its own shard of the KV heads;
  3. load `lora_loads` into their device slots (scheduler/lora.py decides them), then
     create state for `new_seqs`, append `appended_blocks`, replace `replaced_tables`;
  4. run the forward pass over the batch (`seq_ids` order), writing KV at the slots given
     by each sequence's block table and positions `start_pos[i] .. start_pos[i]+query_lens[i]-1`;
  5. sample one token for every sequence with `do_sample[i]`, in batch order (rank 0 returns
     them in a StepResult), and, for a sequence whose NewSeq carried `prompt_token_ids`,
     the log-probabilities of the prompt tokens its chunk predicts (`PromptLogprobs`); a row with `num_draft_tokens[i] = d > 0` (speculative decoding: a
     verify row, its last d input ids are proposed tokens) samples at its last d + 1
     positions and keeps the longest prefix agreeing with the proposal plus the next token
     (workers/rejection_sampler.py). Proposals given as `DRAFT_TOKEN` are the workers' draft
     model's, computed on the device before the forward (workers/draft_runner.py).

Async scheduling: the scheduler may build plan N+1 before it has plan N's result. A decode
in plan N+1 whose input is the token plan N samples for that sequence carries
`PENDING_TOKEN` in `input_ids`; the workers fill it in from the token they sampled for that
sequence in the plan they executed just before (rank 0 broadcasts it to the other ranks),
so plans run strictly in order and a pending token always refers to the previous plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scheduler.sampling_params import SamplingParams

_EMPTY_PAIRS = np.zeros((0, 2), dtype=np.int64)
_EMPTY_ROWS = np.zeros(0, dtype=np.int64)
_EMPTY_ROWS.flags.writeable = False

# In StepPlan.input_ids: the token the previous plan samples for this sequence.
PENDING_TOKEN = -1
# In StepPlan.input_ids, only among a verify row's proposals: a token the workers' draft
# model proposes in this very step (speculative decoding with a draft model).
DRAFT_TOKEN = -2


def empty_pairs() -> np.ndarray:
    """A [0, 2] int64 array: no swap or copy pairs."""
    return _EMPTY_PAIRS.copy()


@dataclass(slots=True)
class LoRAWeights:
    """One adapter's tensors, full (unsharded), float32, as PEFT names the modules.

    `tensors["layers.{i}.{module}"] = (A [r, in_features], B [out_features, r])` for each
    adapted module (q/k/v/o/gate/up/down_proj) of decoder layer i, B already multiplied by
    the adapter's scaling (lora_alpha / r, or / sqrt(r) with use_rslora). Each rank shards
    them as it shards the base layer (workers/lora/layers.py).
    """

    rank: int
    tensors: dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass(slots=True)
class LoRALoad:
    """Put adapter `lora_id` into device slot `slot` before this step's forward pass.
    `weights` are attached by the engine from its host cache (cluster/engine/lora.py)."""

    slot: int
    lora_id: int
    weights: LoRAWeights | None = None


@dataclass(slots=True)
class NewSeq:
    """A sequence the workers hold no state for: first schedule, or resume after preemption.

    `computed_token_ids` are the tokens whose KV is already in the cache when this step
    starts (a prefix-cache hit, or everything computed before a swap-out): exactly
    `start_pos` of them. Later tokens arrive through `StepPlan.input_ids` as they are computed,
    so a worker's token history for the sequence is always `computed_token_ids` followed by
    every token it was given to compute.
    """

    seq_id: int
    request_id: str
    seq_index: int  # which of the request's n samples; seeded sampling mixes it into the seed
    prompt_len: int  # tokens [0, prompt_len) of the history are the prompt (for penalties)
    computed_token_ids: list[int]
    block_table: list[int]  # the whole table, GPU block ids
    sampling_params: SamplingParams
    # The whole prompt, sent only when the sequence computes prompt logprobs (its sampling
    # params ask for them and it is the request's sample 0): the chunk ending at position j
    # predicts prompt token j + 1, which may be in the next chunk.
    prompt_token_ids: list[int] | None = None
    lora_slot: int = -1  # the device slot of its adapter (-1: the base model)


@dataclass(slots=True)
class StepPlan:
    """One step of work for every tensor-parallel rank.

    Batch order: sequences in decode come first, then prefill chunks. `input_ids` is the
    concatenation of each scheduled sequence's tokens to compute, in batch order.
    Invariants: len(seq_ids) == len(query_lens) == len(start_pos) == len(do_sample);
    input_ids.size == query_lens.sum(); every id in seq_ids has state on the worker after
    step 3 above; a block table covers at least start_pos + query_lens tokens.
    """

    step_id: int
    seq_ids: np.ndarray  # int64 [B]
    query_lens: np.ndarray  # int32 [B] tokens computed this step
    start_pos: np.ndarray  # int32 [B] tokens already in the KV cache before this step
    input_ids: np.ndarray  # int64 [sum(query_lens)]
    do_sample: np.ndarray  # bool [B] sample after this step (the chunk reaches the last token)
    new_seqs: list[NewSeq] = field(default_factory=list)
    appended_blocks: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> new ids
    replaced_tables: dict[int, list[int]] = field(default_factory=dict)  # after copy-on-write
    dropped_seq_ids: list[int] = field(default_factory=list)
    swap_out: np.ndarray = field(default_factory=empty_pairs)  # int64 [k, 2] (gpu, cpu)
    swap_in: np.ndarray = field(default_factory=empty_pairs)  # int64 [k, 2] (cpu, gpu)
    copies: np.ndarray = field(default_factory=empty_pairs)  # int64 [k, 2] (src gpu, dst gpu)
    offload: np.ndarray = field(default_factory=empty_pairs)  # int64 [k, 2] (gpu, tier)
    load: np.ndarray = field(default_factory=empty_pairs)  # int64 [k, 2] (tier, gpu)
    # Structured outputs: which of the step's sampled rows (indices in batch order among the
    # do_sample rows) are constrained by a grammar. Their bitmask reaches rank 0 after the
    # plan, through Executor.provide_bitmask; rank 0 samples the step once it has it.
    constrained_rows: np.ndarray = field(default_factory=lambda: _EMPTY_ROWS)
    # Speculative decoding: int32 [B] proposed tokens at the end of each row (None: no row
    # has any). A verify row samples; its rejected proposals' slots are the scheduler's to
    # give back once the result is in.
    num_draft_tokens: np.ndarray | None = None
    # LoRA: adapters to load into device slots before the new sequences arrive (step 3)
    lora_loads: list[LoRALoad] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_constrained(self) -> int:
        return int(self.constrained_rows.shape[0])

    @property
    def is_empty(self) -> bool:
        """No forward pass; the plan may still carry drops and swaps."""
        return self.num_seqs == 0

    @property
    def is_noop(self) -> bool:
        """Nothing at all for the workers: no batch, no drops, no swaps or copies."""
        return (self.num_seqs == 0 and not self.dropped_seq_ids and not len(self.swap_out)
                and not len(self.swap_in) and not len(self.copies) and not len(self.offload)
                and not len(self.load) and not self.lora_loads)


@dataclass(slots=True)
class PromptLogprobs:
    """Prompt log-probabilities one step computed (rank 0's, in a StepResult).

    Entry r covers `counts[r]` consecutive prompt tokens of request `request_ids[r]`, starting
    at prompt index `starts[r]` (>= 1: the first prompt token has no prediction); the per-token
    arrays hold the entries' tokens back to back: the token's log-probability under the raw
    model distribution (log-softmax of the logits), its rank in that distribution (1: the most
    likely), and the top K token ids and log-probabilities (K the largest prompt_logprobs
    asked in the step; an entry that asked for fewer reads its first few).
    """

    request_ids: list[str]
    starts: np.ndarray  # int64 [R]
    counts: np.ndarray  # int64 [R]
    logprobs: np.ndarray  # float32 [M]
    ranks: np.ndarray  # int64 [M]
    top_token_ids: np.ndarray  # int64 [M, K]
    top_logprobs: np.ndarray  # float32 [M, K]

    def owned(self) -> PromptLogprobs:
        """These arrays, copied (see StepResult.owned)."""
        return PromptLogprobs(list(self.request_ids), *(np.array(a, copy=True) for a in (
            self.starts, self.counts, self.logprobs, self.ranks, self.top_token_ids,
            self.top_logprobs)))


@dataclass(slots=True)
class StepResult:
    """Rank 0's answer to a StepPlan: one sampled token per sequence with do_sample, in batch order.

    `logprobs` is the chosen token's log-probability (of the processed distribution, as
    vLLM reports it) for every sampled sequence, filled when any sequence in the step asked
    for logprobs, else None. `top_token_ids` / `top_logprobs` are [S, K] with K the largest
    `logprobs` requested in the step (a sequence that asked for fewer reads its first few).
    """

    step_id: int
    seq_ids: np.ndarray  # int64 [S]
    token_ids: np.ndarray  # int64 [S]
    logprobs: np.ndarray | None = None  # float32 [S]
    top_token_ids: np.ndarray | None = None  # int64 [S, K]
    top_logprobs: np.ndarray | None = None  # float32 [S, K]
    forward_seconds: float = 0.0  # time rank 0 spent executing the plan (for overhead metrics)
    # Speculative decoding (the plan had num_draft_tokens): int32 [S] tokens each sampled row
    # yields (its accepted proposals + 1). The per-token arrays above then hold d + 1 entries
    # per sampled row (d its proposals), the first num_tokens[i] of which are its tokens.
    num_tokens: np.ndarray | None = None
    prompt_logprobs: PromptLogprobs | None = None  # sequences computing prompt logprobs
    # A pooling runner's output (workers/pooler.py): float32 [S, D], one vector per sampled
    # row (whose token id is a placeholder 0: the request finishes with this step).
    pooled: np.ndarray | None = None

    def owned(self) -> StepResult:
        """This result with arrays that own their memory. A result read from a Ray Compiled
        Graph channel is a zero-copy view of the channel's shared buffer; held past the
        graph's teardown (in a traceback, at exit) its release crashes the process."""
        def own(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else np.array(a, copy=True)

        return StepResult(self.step_id, own(self.seq_ids), own(self.token_ids),
                          own(self.logprobs), own(self.top_token_ids), own(self.top_logprobs),
                          self.forward_seconds, own(self.num_tokens),
                          None if self.prompt_logprobs is None else self.prompt_logprobs.owned(),
                          own(self.pooled))
