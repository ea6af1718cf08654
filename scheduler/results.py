"""Applying a step's sampled tokens: append them, decide stop tokens and lengths, finish.

The scheduler's side of vLLM's semantics, in token ids only: EOS (unless ignore_eos) and
stop_token_ids finish a sequence with "stop" once it has more than min_tokens outputs (the
sampler does not mask them before, so they are ignored instead); max_tokens and max_model_len
finish it with "length"; checked in that order, so a stop token on the last allowed token
reports "stop". Text, stop strings and logprobs are the output processor's (cluster/); a stop
string it finds finishes the sequence through Scheduler.stop_by_string.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from scheduler.ahead import PlansInFlight
from scheduler.decode_lane import DecodeLane, LaneRows
from scheduler.outputs import StepOutcome
from scheduler.plan import StepPlan, StepResult
from scheduler.queues import RequestQueues
from scheduler.request import Request, Seq, SequenceStatus
from scheduler.speculative import Speculator

_in_lane = attrgetter("in_lane")
_STOPPED = SequenceStatus.FINISHED_STOPPED
_LENGTH = SequenceStatus.FINISHED_LENGTH


class ResultApplier:
    """Owns what applying results needs beyond the queues: every stop token id seen (as an
    array, to screen the decode lane's rows at once), the sequences finished outside a step
    still to report, and the count of tokens appended. `apply` is the entry point."""

    def __init__(self, queues: RequestQueues, lane: DecodeLane, inflight: PlansInFlight,
                 spec: Speculator | None = None) -> None:
        self.queues = queues
        self.spec = spec
        self.lane = lane
        self.inflight = inflight
        self._stop_ids: set[int] = set()
        self._stop_id_array = np.zeros(0, dtype=np.int64)
        self._early: list[tuple[Request, Seq]] = []
        self.generation_tokens_total = 0

    def watch_stop_ids(self, stop_token_ids: dict[int, int | None]) -> None:
        """A new request's stop token ids (EOS included)."""
        if not self._stop_ids.issuperset(stop_token_ids):
            self._stop_ids.update(stop_token_ids)
            self._stop_id_array = np.array(sorted(self._stop_ids), dtype=np.int64)

    def finished_early(self, req: Request, seq: Seq) -> None:
        """A sequence finished while a step was being scheduled: reported with the next result."""
        self._early.append((req, seq))

    def apply(self, plan: StepPlan, result: StepResult | None) -> StepOutcome:
        """Scheduler.apply_result (documented there)."""
        self.inflight.check_next(plan.step_id)
        early, self._early = self._early, []
        if result is None:
            if plan.do_sample.any():
                raise ValueError(f"step {plan.step_id} samples {np.count_nonzero(plan.do_sample)} "
                                 "sequences but no StepResult was given")
            self.inflight.land()
            return StepOutcome([], [], [], [], [], None, early)
        num_sampled = int(np.count_nonzero(plan.do_sample))
        if result.step_id != plan.step_id or result.seq_ids.shape[0] != num_sampled:
            raise ValueError(f"StepResult of step {result.step_id} with {result.seq_ids.shape[0]} "
                             f"tokens does not answer plan {plan.step_id} "
                             f"({num_sampled} sequences sample)")
        self.inflight.land()
        if result.num_tokens is not None:  # verify rows: several tokens per row
            out = self.spec.apply(plan, result, early, self.queues, self.queues.kv)
            self.generation_tokens_total += len(out.token_ids)
            return out
        lane_rows = self.lane.take_rows(plan.step_id)
        fast = self._fast_rows(lane_rows, plan, result) if lane_rows is not None else None
        seq_ids = result.seq_ids.tolist()
        token_ids = result.token_ids.tolist()
        start = 0
        if fast is not None and all(fast):
            # Every lane row needs no decision: their tokens in bulk, the other rows below.
            start = n = len(fast)
            for tokens, token in zip(lane_rows.token_lists, token_ids):
                tokens.append(token)
            out = StepOutcome(list(lane_rows.reqs), list(lane_rows.seqs), token_ids[:n],
                              [None] * n, list(range(n)), result, early)
        else:
            out = StepOutcome([], [], [], [], [], result, early)
        fast = (fast or []) + [False] * (len(seq_ids) - len(fast or ()))
        self._apply_rows(out, seq_ids, token_ids, start, fast, lane_rows)
        self.generation_tokens_total += len(out.token_ids)
        return out

    def _apply_rows(self, out: StepOutcome, seq_ids: list[int], token_ids: list[int],
                    start: int, fast: list[bool], lane_rows: LaneRows | None) -> None:
        """Rows from `start` on, one by one, into `out`; fast[row]: a lane row that needs no
        decision (see _fast_rows)."""
        reqs, seqs, tokens_out = out.reqs, out.seqs, out.token_ids
        finished, rows = out.finished, out.rows
        seqs_get = self.queues.seqs.get
        finish_seq = self.queues.finish_seq
        lane_reqs = lane_rows.reqs if lane_rows is not None else ()
        lane_seqs = lane_rows.seqs if lane_rows is not None else ()
        for row, sid, token, plain in zip(range(start, len(seq_ids)), seq_ids[start:],
                                          token_ids[start:], fast[start:]):
            if plain:
                req = lane_reqs[row]
                seq = lane_seqs[row]
                seq.token_ids.append(token)
                status = None
            else:
                entry = seqs_get(sid)
                if entry is None:
                    continue  # aborted, or finished by the token of the step before (async)
                req, seq = entry
                tokens = seq.token_ids
                tokens.append(token)
                status = None
                stop = req.stop_token_ids
                if (token in stop
                        and len(tokens) - seq.prompt_len > req.sampling_params.min_tokens):
                    status = _STOPPED
                    finish_seq(req, seq, status, stop[token])
                elif len(tokens) >= seq.max_len:
                    status = _LENGTH
                    finish_seq(req, seq, status)
            reqs.append(req)
            seqs.append(seq)
            tokens_out.append(token)
            finished.append(status)
            rows.append(row)

    def _fast_rows(self, lane_rows: LaneRows, plan: StepPlan, result: StepResult
                   ) -> list[bool] | None:
        """Which of a plan's first rows (its decode lane rows) need no decision: a member
        still running whose token is no stop token and does not reach its length. None when
        the result is not in batch order (then every row looks its sequence up)."""
        n = len(lane_rows.pos)
        if not (result.seq_ids[:n] == plan.seq_ids[:n]).all():
            return None
        # Its token appended, a sequence has pos + 2 tokens.
        ok = lane_rows.pos + 2 < lane_rows.max_len
        # Still a member: running, not finished or aborted since the plan was made (when
        # nobody has left the lane since, all are).
        if lane_rows.departures != self.lane.departures:
            ok &= np.fromiter(map(_in_lane, lane_rows.reqs), bool, n)
        stop_ids = self._stop_id_array
        if len(stop_ids) > 8:
            ok &= ~np.isin(result.token_ids[:n], stop_ids)
        elif len(stop_ids):  # (np.isin's fixed cost is that of some ten comparisons)
            tokens = result.token_ids[:n]
            for token in stop_ids.tolist():
                ok &= tokens != token
        return ok.tolist()
