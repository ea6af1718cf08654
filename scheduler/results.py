"""Applying a step's sampled tokens: output deltas, stop conditions, finished sequences."""

from __future__ import annotations

from collections import deque
from itertools import repeat
from operator import attrgetter

import numpy as np

from kvcache import KVCacheManager
from scheduler.decode_lane import PLAIN, DecodeLane
from scheduler.output_processor import flush_text, process_token, token_text
from scheduler.outputs import CompletionOutput, RequestOutput
from scheduler.plan import StepPlan, StepResult
from scheduler.request import Request, Sequence, SequenceStatus

_RUNNING = SequenceStatus.RUNNING
_in_lane = attrgetter("in_lane")


class ResultsMixin:
    """Scheduler's result side. Mixed into Scheduler, whose state it shares (declared below)."""

    kv: KVCacheManager
    requests: dict[str, Request]
    _seqs: dict[int, tuple[Request, Sequence]]
    _inflight: deque[int]
    waiting: deque[Request]
    swapped: deque[Request]
    _pending_drops: list[int]
    _deferred: list[RequestOutput]
    _running_dirty: bool
    _lane: DecodeLane
    _lane_plans: dict[int, tuple[list[Request], list[Sequence], np.ndarray, np.ndarray,
                                 np.ndarray, int]]
    _stop_id_array: np.ndarray
    generation_tokens_total: int
    # (delta, request, sequence, token, stopped by a stop token, finished): text owed by
    # apply_result(defer_text=True), filled in by finish_text() in token order
    _text_todo: list[tuple[CompletionOutput, Request, Sequence, int, bool, bool]]

    def apply_result(self, plan: StepPlan, result: StepResult | None,
                     defer_text: bool = False) -> list[RequestOutput]:
        """Append the sampled tokens, check stop conditions, and return output deltas.

        `result` may be None for a plan in which no sequence samples. Tokens of sequences
        aborted while the step ran are ignored. With defer_text, sequences without stop
        strings (the only ones whose text cannot end them) get their deltas' text only when
        finish_text() runs, so the engine can schedule and launch the next step first; every
        other decision (stop tokens, lengths, freed blocks) is taken here as usual.
        """
        inflight = self._inflight
        if not inflight or inflight[0] != plan.step_id:
            raise RuntimeError(f"apply_result() for step {plan.step_id}, but the plans awaiting "
                               f"results are {list(inflight)} (apply them in order)")
        if self._text_todo:
            self.finish_text()
        outputs, self._deferred = self._deferred, []
        if result is None:
            if plan.do_sample.any():
                raise ValueError(f"step {plan.step_id} samples {np.count_nonzero(plan.do_sample)} "
                                 "sequences but no StepResult was given")
            inflight.popleft()
            return outputs
        num_sampled = int(np.count_nonzero(plan.do_sample))
        if result.step_id != plan.step_id or result.seq_ids.shape[0] != num_sampled:
            raise ValueError(f"StepResult of step {result.step_id} with {result.seq_ids.shape[0]} "
                             f"tokens does not answer plan {plan.step_id} "
                             f"({num_sampled} sequences sample)")
        inflight.popleft()
        touched: dict[str, tuple[Request, RequestOutput]] = {}
        seqs_get = self._seqs.get
        emit = outputs.append
        new_obj = object.__new__
        todo = self._text_todo.append
        num_tokens = 0
        seq_ids = result.seq_ids.tolist()
        fast, lane_reqs, lane_seqs = self._lane_fast_rows(plan, result, defer_text)
        if fast is not None:
            fast += [False] * (len(seq_ids) - len(fast))
        else:
            fast = repeat(False)
        for row, (sid, token, lane_row) in enumerate(
                zip(seq_ids, result.token_ids.tolist(), fast)):
            if lane_row:
                # A decode lane member still running, whose token can neither stop it nor
                # reach its length, and whose output is plain or deferred (_lane_fast_rows).
                req = lane_reqs[row]
                seq = lane_seqs[row]
            else:
                entry = seqs_get(sid)
                if entry is None:
                    continue  # aborted, or finished by the token of the step before (async)
                req, seq = entry
            tokens = seq.token_ids
            tokens.append(token)
            num_tokens += 1
            if lane_row or ((req.plain or (defer_text and req.deferrable))
                            and token not in req.stop_token_ids and len(tokens) < seq.max_len):
                # No logprobs, no stop, and no text now (none at all, or deferred): the delta
                # is just the token. Built field by field: the dataclass __init__ call costs
                # more than the rest of this loop.
                comp = new_obj(CompletionOutput)
                comp.index = seq.index
                comp.token_ids = [token]
                comp.text = ""
                comp.finish_reason = comp.stop_reason = comp.logprobs = None
                if not req.plain:
                    todo((comp, req, seq, token, False, False))
                if req.n == 1:
                    out = new_obj(RequestOutput)
                    out.request_id = req.request_id
                    out.prompt_token_ids = req.prompt_token_ids
                    out.outputs = [comp]
                    out.finished = False
                    out.num_cached_tokens = req.num_cached_tokens
                    emit(out)
                    continue
            else:
                comp = self._token_output(req, seq, token, result, row, defer_text)
                if req.n == 1:
                    out = RequestOutput(req.request_id, req.prompt_token_ids, [comp],
                                        comp.finish_reason is not None, req.num_cached_tokens)
                    emit(out)
                    if out.finished:
                        self._running_dirty = True
                        self._forget(req)
                    continue
            hit = touched.get(req.request_id)
            if hit is None:
                out = RequestOutput(req.request_id, req.prompt_token_ids, [comp], False,
                                    req.num_cached_tokens)
                touched[req.request_id] = (req, out)
                emit(out)
            else:
                hit[1].outputs.append(comp)
        self.generation_tokens_total += num_tokens
        for req, out in touched.values():
            if req.is_finished:
                out.finished = True
                self._running_dirty = True
                self._forget(req)
        return outputs

    def _lane_fast_rows(self, plan: StepPlan, result: StepResult, defer_text: bool
                        ) -> tuple[list[bool] | None, list[Request], list[Sequence]]:
        """For a plan that began with decode lane rows: which of its first rows take the plain
        output path, with those rows' requests and sequences."""
        lane_plan = self._lane_plans.pop(plan.step_id, None)
        if lane_plan is None:
            return None, [], []
        reqs, seqs, pos, max_len, kind, departures = lane_plan
        n = len(pos)
        if not (result.seq_ids[:n] == plan.seq_ids[:n]).all():
            return None, [], []  # (not in batch order: every row looks its sequence up)
        # Its token appended, a sequence has pos + 2 tokens.
        ok = pos + 2 < max_len
        ok &= (kind != 0) if defer_text else (kind == PLAIN)
        # Still a member: running, not finished or aborted since the plan was made (when
        # nobody has left the lane since, all are).
        if departures != self._lane.departures:
            ok &= np.fromiter(map(_in_lane, reqs), bool, n)
        stop_ids = self._stop_id_array
        if len(stop_ids) > 8:
            ok &= ~np.isin(result.token_ids[:n], stop_ids)
        elif len(stop_ids):  # (np.isin costs ~30 us; a comparison per id ~3)
            tokens = result.token_ids[:n]
            for token in stop_ids.tolist():
                ok &= tokens != token
        return ok.tolist(), reqs, seqs

    def _token_output(self, req: Request, seq: Sequence, token: int, result: StepResult,
                      row: int, defer_text: bool = False) -> CompletionOutput:
        """The output delta of a token just appended: stop checks, text, logprobs."""
        status, text, stop_reason, logprobs = process_token(req, seq, token, result, row,
                                                            defer_text)
        deferred = text is None
        if status is None:
            comp = CompletionOutput(seq.index, [token], text or "", None, None, logprobs)
        else:
            self._release(seq, self._pending_drops)
            comp = self._finish_output(req, seq, status, [token], text or "", stop_reason,
                                       logprobs, flush=not deferred)
        if deferred:
            stopped = status is SequenceStatus.FINISHED_STOPPED
            self._text_todo.append((comp, req, seq, token, stopped, status is not None))
        return comp

    def finish_text(self) -> None:
        """Fill in the text apply_result(defer_text=True) left out, in token order."""
        todo = self._text_todo  # cleared in place: apply_result holds its append
        for comp, req, seq, token, stopped, finished in todo:
            comp.text = token_text(req, seq, token, stopped, finished)
        todo.clear()

    def _finish_output(self, req: Request, seq: Sequence, status: SequenceStatus,
                       token_ids: list[int], text: str, stop_reason: str | int | None,
                       logprobs: list[dict[int, float]] | None,
                       flush: bool = True) -> CompletionOutput:
        """Finish a sequence whose blocks are released; its held-back text goes out unless a
        stop string ended it (then the rest is cut off). flush=False leaves that to
        finish_text (the sequence's last token is still to be detokenized)."""
        if flush and not isinstance(stop_reason, str):
            if self._text_todo:
                self.finish_text()  # this sequence's earlier tokens come first
            text += flush_text(seq)
        seq.stop_reason = stop_reason
        self._lane.evict(req)
        before = req.status
        self._seqs.pop(seq.seq_id, None)  # a later plan's token for it is ignored
        if req.finish_seq(seq, status) and before is not _RUNNING:
            # Preempted with its last token in flight (async scheduling): leave the queue now.
            (self.swapped if before is SequenceStatus.SWAPPED else self.waiting).remove(req)
        if logprobs is None and req.sampling_params.logprobs is not None:
            logprobs = []
        return CompletionOutput(seq.index, token_ids, text, status.finish_reason, stop_reason,
                                logprobs)

    def _release(self, seq: Sequence, drops: list[int]) -> None:
        """Free the sequence's blocks and have the workers drop its state."""
        self.kv.free(seq.seq_id)
        if seq.on_worker:
            drops.append(seq.seq_id)
            seq.on_worker = False

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        for seq in req.seqs:
            self._seqs.pop(seq.seq_id, None)
