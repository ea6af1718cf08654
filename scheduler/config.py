"""Scheduler policy knobs."""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("swap", "recompute")


@dataclass(slots=True)
class SchedulerConfig:
    """Policy knobs, vLLM's names.

    Invariants checked here: every limit >= 1; max_num_batched_tokens >= max_num_seqs (so the
    decodes of every running sequence always fit in one step and prefills still progress);
    1 <= max_mixed_prefill_tokens <= max_num_batched_tokens when set, with chunked prefill
    (prefills progress beside decodes, and the cap is not a silent no-op);
    without chunked prefill, max_num_batched_tokens >= max_model_len (so any sequence can be
    prefilled in one step).
    """

    max_num_seqs: int = 256  # running sequences at once (a request with n samples counts n)
    max_num_batched_tokens: int = 8192  # tokens computed per step
    max_model_len: int = 4096  # prompt + output tokens of one sequence
    enable_chunked_prefill: bool = True
    preemption_mode: str | None = None  # "swap" | "recompute" | None (= swap when CPU blocks exist)
    max_loras: int = 0  # LoRA adapters resident at once (device slots); 0: no LoRA requests
    # plans of disjoint sequences in flight at once (pipeline parallelism: one per stage,
    # scheduler/ahead.py); 1: one plan, plus async scheduling's one ahead
    micro_batches: int = 1
    # Prompt tokens a step that carries decodes may compute (None: the rest of the budget).
    # Every stream decoding in a step waits for the whole step, so this bounds how much
    # longer than a decode step its token takes while prompts are prefilled beside it; a
    # step without decodes still fills max_num_batched_tokens (first tokens stay fast).
    max_mixed_prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}); raise max_num_batched_tokens or lower max_num_seqs")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}); enable chunked prefill or "
                "raise max_num_batched_tokens")
        cap = self.max_mixed_prefill_tokens
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1
                                or cap > self.max_num_batched_tokens):
            raise ValueError(
                f"max_mixed_prefill_tokens must be an integer in [1, max_num_batched_tokens = "
                f"{self.max_num_batched_tokens}] or None (no cap); got {cap!r}")
        if cap is not None and not self.enable_chunked_prefill:
            raise ValueError("max_mixed_prefill_tokens needs enable_chunked_prefill (a prompt "
                             "longer than the cap could not start while others decode)")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) \
                or self.max_loras < 0:
            raise ValueError(f"max_loras must be an integer >= 0; got {self.max_loras!r}")
        if self.preemption_mode is not None and self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be 'swap', 'recompute' or None; got {self.preemption_mode!r}")
