"""Sampled ids (and logprobs) on their way to the host, in buffers allocated once.

`put` enqueues non-blocking copies of a step's sampler outputs into a ring of pinned host
buffers and records an event behind them; `take` waits for that event (the one host wait of
a step) and returns the StepResult built from the buffers. On CPU the copies simply run.
A step's prompt logprobs (`put_prompt`) vary in size with its prefill chunks: they are copied
into host tensors made for the step (pinned on CUDA), behind the same event; so are a pooling
step's pooled vectors (`put_pooled`), whose rows carry token id 0 (workers/pooler.py).

Invariant: a slot is reused `depth` puts later, so at most `depth - 1` steps may be put and
not yet taken (the worker enforces it); the arrays `take` returns are copies (the slot is
free again once taken).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from scheduler.plan import PromptLogprobs, StepResult
from scheduler.sampling_params import MAX_LOGPROBS
from workers.prompt_logprobs import PromptRows
from workers.sampler import SamplerOutput, TokenLogprobs


class _Slot:
    def __init__(self, rows: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.tokens = torch.empty(rows, dtype=torch.int64, pin_memory=pin)
        self.tokens_np = self.tokens.numpy()  # (a view: take reads it without a torch call)
        # put's last slice of `tokens`, kept: a steady batch makes no view per step
        self.put_rows, self.put_view = 0, self.tokens[:0]
        self.logprobs = torch.empty(rows, dtype=torch.float32, pin_memory=pin)
        self.top_ids = torch.empty(rows, MAX_LOGPROBS + 1, dtype=torch.int64, pin_memory=pin)
        self.top_logprobs = torch.empty(rows, MAX_LOGPROBS + 1, dtype=torch.float32,
                                        pin_memory=pin)
        self.num_tokens = torch.empty(rows, dtype=torch.int32, pin_memory=pin)
        self.num_verified = -1  # sampled rows with a num_tokens (verify steps); -1: none
        self.start = torch.cuda.Event(enable_timing=True) if pin else None
        self.done = torch.cuda.Event(enable_timing=True) if pin else None
        self.rows = 0
        self.num_top = -1  # -1: no logprobs in this step
        self.t0 = 0.0  # when the step began (CPU)
        self.seconds = 0.0  # (CPU) from t0 to the last put
        self.prompt: tuple[PromptRows, list[torch.Tensor]] | None = None
        self.pooled: torch.Tensor | None = None  # float32 [rows, D] (pooling runner)
        self.pin = pin


class StepOutputs:
    """The ring of output slots (see the module docstring)."""

    def __init__(self, device: torch.device, rows: int, depth: int) -> None:
        self.device = device
        self.depth = depth
        self._slots = [_Slot(rows, device) for _ in range(depth)]
        self._next = 0

    def begin(self) -> int:
        """Claim the next slot at a step's launch (on CUDA its start event is recorded)."""
        index = self._next
        self._next = (index + 1) % self.depth
        slot = self._slots[index]
        slot.rows, slot.num_top, slot.seconds, slot.t0 = 0, -1, 0.0, time.perf_counter()
        slot.num_verified = -1
        slot.prompt = slot.pooled = None
        if slot.start is not None:
            slot.start.record()
        return index

    def put(self, index: int, out: SamplerOutput, rows: int,
            num_tokens: torch.Tensor | None = None) -> None:
        """Enqueue the copies of a step's sampled rows into its slot (and of num_tokens, a
        verify step's tokens per sampled sequence: StepResult.num_tokens)."""
        slot = self._slots[index]
        if rows > slot.tokens.shape[0]:  # a batch larger than max_num_seqs (profiling)
            self._slots[index] = slot = self._grown(slot, rows)
        slot.rows = rows
        if slot.put_rows != rows:
            slot.put_rows, slot.put_view = rows, slot.tokens[:rows]
        slot.put_view.copy_(out.token_ids, non_blocking=True)
        if num_tokens is not None:
            slot.num_verified = n = num_tokens.shape[0]
            slot.num_tokens[:n].copy_(num_tokens, non_blocking=True)
        if out.logprobs is not None:
            k = out.top_token_ids.shape[1]
            slot.num_top = k
            slot.logprobs[:rows].copy_(out.logprobs, non_blocking=True)
            slot.top_ids[:rows, :k].copy_(out.top_token_ids, non_blocking=True)
            slot.top_logprobs[:rows, :k].copy_(out.top_logprobs, non_blocking=True)
        _stamp(slot)

    def put_prompt(self, index: int, rows: PromptRows, out: TokenLogprobs) -> None:
        """Enqueue the copies of a step's prompt logprobs into its slot."""
        slot = self._slots[index]
        host = []
        for t in (out.logprobs, out.ranks, out.top_token_ids, out.top_logprobs):
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=slot.pin)
            h.copy_(t, non_blocking=True)
            host.append(h)
        slot.prompt = (rows, host)
        _stamp(slot)

    def put_pooled(self, index: int, pooled: torch.Tensor) -> None:
        """Enqueue the copy of a pooling step's output, one row per finishing sequence (its
        token: the placeholder 0)."""
        slot = self._slots[index]
        rows = pooled.shape[0]
        if rows > slot.tokens.shape[0]:
            self._slots[index] = slot = self._grown(slot, rows)
        slot.rows = rows
        slot.tokens[:rows].zero_()
        slot.pooled = torch.empty(pooled.shape, dtype=torch.float32, pin_memory=slot.pin)
        slot.pooled.copy_(pooled, non_blocking=True)
        _stamp(slot)

    def _grown(self, slot: _Slot, rows: int) -> _Slot:
        grown = _Slot(rows, self.device)
        grown.start, grown.done, grown.seconds = slot.start, slot.done, slot.seconds
        grown.num_verified, grown.t0, grown.prompt = slot.num_verified, slot.t0, slot.prompt
        return grown

    def ready(self, index: int) -> bool:
        """Whether the slot's copies have run (take would not wait)."""
        done = self._slots[index].done
        return done is None or done.query()

    def take(self, index: int, step_id: int, seq_ids: np.ndarray) -> StepResult:
        """Wait for the slot's copies and build the step's StepResult (arrays copied out)."""
        slot = self._slots[index]
        seconds = slot.seconds
        if slot.done is not None:
            slot.done.synchronize()  # the designed wait: step N's ids, while N+1 runs
            seconds = slot.start.elapsed_time(slot.done) / 1e3
        n = slot.rows
        result = StepResult(step_id, seq_ids, slot.tokens_np[:n].copy())
        if slot.num_top >= 0:
            k = slot.num_top
            result.logprobs = slot.logprobs.numpy()[:n].copy()
            result.top_token_ids = slot.top_ids.numpy()[:n, :k].copy()
            result.top_logprobs = slot.top_logprobs.numpy()[:n, :k].copy()
        if slot.num_verified >= 0:
            result.num_tokens = slot.num_tokens.numpy()[:slot.num_verified].copy()
        if slot.prompt is not None:
            rows, (lps, ranks, top_ids, top_lps) = slot.prompt
            result.prompt_logprobs = PromptLogprobs(
                rows.request_ids, rows.starts, rows.counts, lps.numpy(), ranks.numpy(),
                top_ids.numpy(), top_lps.numpy())
            slot.prompt = None
        if slot.pooled is not None:
            result.pooled, slot.pooled = slot.pooled.numpy(), None
        result.forward_seconds = seconds
        return result


def _stamp(slot: _Slot) -> None:
    """Mark the end of the copies a step has put so far: its event on CUDA, its time on CPU."""
    if slot.done is not None:
        slot.done.record()
    else:
        slot.seconds = time.perf_counter() - slot.t0
