"""Scheduler policy knobs."""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("swap", "recompute")


@dataclass(slots=True)
class SchedulerConfig:
    """Policy knobs, vLLM's names.

    Invariants checked here: every limit >= 1; max_num_batched_tokens >= max_num_seqs (so the
    decodes of every running sequence always fit in one step and prefills still progress);
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
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) \
                or self.max_loras < 0:
            raise ValueError(f"max_loras must be an integer >= 0; got {self.max_loras!r}")
        if self.preemption_mode is not None and self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be 'swap', 'recompute' or None; got {self.preemption_mode!r}")
