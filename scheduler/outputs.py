"""What the scheduler hands the engine (StepOutcome: token ids and finish decisions, and
SchedulerStats), and the engine's own output deltas (RequestOutput, CompletionOutput), which
the output processor builds (cluster/engine/output_processor.py; they live here until the engine
gets its own package, because the HTTP front imports them from here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from scheduler.plan import StepResult
    from scheduler.request import Request, Seq, SequenceStatus


@dataclass(slots=True)
class StepOutcome:
    """What apply_result decided for one step, in token ids and finish decisions only.

    One row per token appended, in the StepResult's order (tokens for sequences that finished
    or were aborted meanwhile are left out), as parallel lists: the request, the sequence,
    the token id, the status the token finished its sequence with (None while it runs; the
    stop token id is then in `seq.stop_reason`), and its row in `result` (for logprobs).
    `finished_early` are sequences that finished without a token since the step before (the
    KV cache could not hold them: "length"); they come before the rows.
    """

    reqs: list[Request]
    seqs: list[Seq]
    token_ids: list[int]
    finished: list[SequenceStatus | None]
    rows: list[int]
    result: StepResult | None
    finished_early: list[tuple[Request, Seq]]


@dataclass(slots=True)
class Logprob:
    """One token's entry in a prompt logprobs dict (vLLM's `Logprob`): its log-probability,
    its rank in the distribution (1: the most likely) and its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# RequestOutput.prompt_logprobs: one entry per prompt token; None for the first (nothing
# predicts it), then {the prompt token: Logprob, each of the top k: Logprob}.
PromptLogprobList = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """The news of one of a request's n sequences since its previous output (a delta).

    `text` never ends inside a UTF-8 character and never holds a prefix of a stop string that
    may still complete (both are held back until resolved). Stop strings are cut off unless
    include_stop_str_in_output; EOS and stop_token_ids are in `token_ids` but not in `text`.
    """

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # None | "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None = None  # per new token {chosen: lp, top ids: lps}


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # only sequences with news this step
    finished: bool  # all n sequences finished
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    replica_id: str | None = None  # the serving replica, on a stream's first output (Serve)
    # SamplingParams.prompt_logprobs: the whole prompt's, on the request's first output only
    prompt_logprobs: PromptLogprobList | None = None
    # a pooling runner's vector for the request (its embedding or score), on its last output
    pooled: np.ndarray | None = None
    # a prefill engine's (kv_role "prefill"): its prompt's KV for the decode side, on its last
    # output (cluster/engine/kv_transport.py KVTransferParams)
    kv_transfer_params: Any = None


@dataclass(slots=True)
class SchedulerStats:
    """Queue lengths (requests), cumulative counters, and the KV cache's own stats."""

    num_waiting: int  # requests waiting for (re)admission, recompute-preempted ones included
    num_running: int
    num_swapped: int
    num_running_seqs: int
    preemptions_swap: int
    preemptions_recompute: int
    prompt_tokens_total: int  # prompt tokens of admitted requests (counted once per request)
    generation_tokens_total: int  # sampled tokens appended
    num_steps: int
    # KVCacheStats fields
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    gpu_usage: float
    cpu_usage: float
    prefix_queries: int
    prefix_hits: int
    evictions: int
    num_offload_blocks: int = 0  # the CPU offload tier (kvcache/offload.py)
    offload_usage: float = 0.0
    external_prefix_queries: int = 0  # tokens looked up in the tier after a GPU miss
    external_prefix_hits: int = 0  # of those, tokens loaded back from the tier
    blocks_offloaded: int = 0
    blocks_loaded: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served by the prefix cache over tokens looked up (0 before any)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass(frozen=True, slots=True)
class QueueLoad:
    """A replica's queued work, as a request router in front of it reads it (`RequestQueues.load`;
    the engine answers it with its KV events, cluster/api/prefix_router.py)."""

    num_waiting: int  # requests not running: new, preempted to recompute, or swapped out
    num_running: int
    # Prompt tokens still to compute before they decode: a waiting request's tokens past the
    # leading blocks cached now or computed first by a request ahead, a running prefill's rest.
    prompt_tokens: int
    request_ids: frozenset[str] = frozenset()  # every unfinished request (what the above count)
