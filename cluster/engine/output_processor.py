"""The output processor: the scheduler's token ids and finish decisions in, RequestOutput
deltas out (vLLM v1's OutputProcessor). It owns, per request, the text state (an incremental
detokenizer per sequence, a stop-string buffer) and the logprob formatting.

vLLM's semantics: EOS (unless ignore_eos) and stop_token_ids stop with "stop" (decided by the
scheduler; the token is in token_ids but not in the text, unless include_stop_str_in_output);
stop strings stop with "stop" and cut the text before the string (after it with
include_stop_str_in_output), found here and handed back through Scheduler.stop_sequence, in
the same step, so the scheduler never schedules the sequence again; none of these stop a
sequence before it has more than min_tokens outputs; max_tokens and max_model_len stop with
"length", unless a stop string completes on that very token (then "stop" wins, as above).

Deferred text (the async engine): with process(defer_text=True) a sequence without stop
strings (whose text cannot end it) gets its deltas' text only when finish_text() runs, so the
engine can schedule and launch the next step first. Invariant: deferred tokens are
detokenized in the order they were sampled, before any later text of the same sequence (a
sequence finishing inline runs finish_text first).

Prompt logprobs: a request's StepResults bring its prompt tokens' values chunk by chunk
(PromptLogprobs); they fill one list as long as the prompt (None first), which goes out whole
on the request's first output, in vLLM's shape ({token id: Logprob}). A position already
filled is kept (a recomputed chunk repeats it); after that first output they are ignored.
"""

from __future__ import annotations

from typing import Any

from cluster.engine.detokenizer import DetokenizerFactory, IncrementalDetokenizer, StopStringBuffer
from scheduler import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    Request,
    RequestOutput,
    SamplingParams,
    Scheduler,
    Seq,
    SequenceStatus,
    StepOutcome,
    StepResult,
)
from scheduler.outputs import PromptLogprobList

_STOPPED = SequenceStatus.FINISHED_STOPPED
_ABORTED = SequenceStatus.FINISHED_ABORTED
_new = object.__new__


class _SeqText:
    """One sequence's text state."""

    __slots__ = ("detok", "stop_buffer", "include_stop")

    def __init__(self, detok: Any, stop_buffer: StopStringBuffer | None,
                 include_stop: bool) -> None:
        self.detok = detok
        self.stop_buffer = stop_buffer
        self.include_stop = include_stop  # include_stop_str_in_output

    def token_text(self, token: int, stopped: bool, finished: bool) -> str:
        """The token's own text (none for a stop token, unless include_stop), then, if the
        sequence finished, what the detokenizer held back."""
        detok = self.detok
        text = detok.step(token) if not stopped or self.include_stop else ""
        return text + detok.flush() if finished else text

    def flush(self) -> str:
        """The text a finishing sequence still holds back (stop-string window, then
        incomplete characters, which come out as U+FFFD exactly as tokenizer.decode shows)."""
        text = self.stop_buffer.flush() if self.stop_buffer is not None else ""
        return text + self.detok.flush()


class _RequestState:
    """What a request needs beyond token ids: text (with a tokenizer) and/or logprobs."""

    __slots__ = ("params", "prompt_token_ids", "seqs", "deferrable", "prompt_logprobs")

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int], text: bool) -> None:
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.seqs: dict[int, _SeqText | None] = {}  # by sequence index, made at its first token
        # text that cannot end it (no stop strings) and nothing else: with deferred text a
        # running token's delta is the token, its text filled in by finish_text
        self.deferrable = (text and not params.stop and params.logprobs is None
                           and params.prompt_logprobs is None)
        # the prompt's logprobs until the first output takes them (None: not asked, or sent)
        self.prompt_logprobs: PromptLogprobList | None = (
            None if params.prompt_logprobs is None else [None] * len(prompt_token_ids))

    def take_prompt_logprobs(self) -> PromptLogprobList | None:
        """The prompt logprobs, the first time (for the request's first output)."""
        lps, self.prompt_logprobs = self.prompt_logprobs, None
        return lps


class OutputProcessor:
    """Turns StepOutcomes into RequestOutput deltas (see the module docstring).

    `detokenizer_factory(prompt_token_ids, skip_special_tokens)` makes each sequence's
    detokenizer (the engine passes a Rust-backed one); by default IncrementalDetokenizer over
    `tokenizer`, which only needs the tokenizer's Python API. Without a tokenizer there is
    no text at all.
    """

    def __init__(self, scheduler: Scheduler, tokenizer: Any = None,
                 detokenizer_factory: DetokenizerFactory | None = None) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.detokenizer_factory = detokenizer_factory
        self._states: dict[str, _RequestState] = {}
        # token id -> convert_ids_to_tokens result, per skip_special_tokens, shared by every
        # IncrementalDetokenizer of this tokenizer
        self._token_cache: dict[bool, dict[int, list[str]]] = {True: {}, False: {}}
        # text owed by process(defer_text=True), in token order: each delta (of one token of
        # sequence `index`, which says whether a stop token stopped it or it finished) and
        # its request's state
        self._text_todo: list[tuple[CompletionOutput, _RequestState]] = []
        self._decoded: dict[int, str] = {}  # token id -> its text alone (prompt logprobs)

    # ---- requests -------------------------------------------------------------------------

    def validate(self, params: SamplingParams) -> None:
        """Raise ValueError for sampling params this processor cannot serve."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none "
                             "(use stop_token_ids)")

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, output_token_ids: list[int] | None = None) -> None:
        """Start tracking a request the scheduler accepted (validate it first).

        A request resumed with `output_token_ids` (generated on another replica, whose deltas
        its client has) replays them through its detokenizer and stop-string buffer, dropping
        their text: what the first replica had sent is exactly what the replay gives, so the
        state after it (characters and a stop-string window held back) is that replica's,
        and the next deltas continue its text with nothing repeated or lost."""
        self.validate(params)
        text = self.tokenizer is not None
        if text or params.logprobs is not None or params.prompt_logprobs is not None:
            state = self._states[request_id] = _RequestState(params, list(prompt_token_ids),
                                                             text)
            if output_token_ids:  # its first output (with the prompt logprobs) went out
                state.take_prompt_logprobs()
            text_state = self._seq_text(state, 0) if output_token_ids else None
            if text_state is not None:
                assert output_token_ids is not None
                for i, token in enumerate(output_token_ids):
                    piece = text_state.token_text(token, False, False)
                    if text_state.stop_buffer is not None:
                        text_state.stop_buffer.feed(piece, i + 1 > params.min_tokens)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort the request in the scheduler; its final delta (None for an unknown id)."""
        req = self.scheduler.abort(request_id)
        self._states.pop(request_id, None)
        if req is None:
            return None
        want_lp = req.sampling_params.logprobs is not None
        outputs = [CompletionOutput(seq.index, [], "", "abort", None, [] if want_lp else None)
                   for seq in req.seqs if seq.status is _ABORTED]
        return RequestOutput(req.request_id, req.prompt_token_ids, outputs, True,
                             req.num_cached_tokens)

    # ---- outputs --------------------------------------------------------------------------

    def process(self, outcome: StepOutcome, defer_text: bool = False) -> list[RequestOutput]:
        """The deltas of one applied step: sequences finished early first, then one delta per
        request with tokens, in the order of their first token."""
        outputs = [self._early_output(req, seq) for req, seq in outcome.finished_early]
        emit = outputs.append
        touched: dict[str, tuple[Request, RequestOutput]] = {}
        states_get = self._states.get
        todo = self._text_todo.append
        result = outcome.result
        if result is not None and result.prompt_logprobs is not None:
            self._absorb_prompt(result.prompt_logprobs)
        cut: set[int] = set()  # sequences a stop string finished in this step
        # speculative decoding: a sequence's tokens after this one in the step (its
        # token_ids already hold them all)
        after: dict[int, int] = {}
        if result is not None and result.num_tokens is not None:
            for seq in outcome.seqs:
                after[seq.seq_id] = after.get(seq.seq_id, -1) + 1
        for req, seq, token, status, row in zip(outcome.reqs, outcome.seqs, outcome.token_ids,
                                                outcome.finished, outcome.rows):
            if cut and seq.seq_id in cut:
                continue  # a stop string earlier in this step's run of tokens (speculation)
            state = states_get(req.request_id)
            if status is None and req.n == 1 and (
                    state is None or (defer_text and state.deferrable)):
                # The delta of a running sequence is its token (text, if any, deferred): the
                # bulk of every step, built field by field because the dataclasses' generated
                # __init__ calls are a visible share of a large step (docs/benchmarks.md).
                comp = _new(CompletionOutput)
                comp.index = seq.index
                comp.token_ids = [token]
                comp.text = ""
                comp.finish_reason = comp.stop_reason = comp.logprobs = None
                if state is not None:
                    todo((comp, state))
                out = _new(RequestOutput)
                out.request_id = req.request_id
                out.prompt_token_ids = req.prompt_token_ids
                out.outputs = [comp]
                out.finished = False
                out.num_cached_tokens = req.num_cached_tokens
                out.replica_id = out.prompt_logprobs = out.pooled = out.kv_transfer_params = None
                emit(out)
                continue
            if state is None:  # no text, no logprobs: the delta is the token
                comp = CompletionOutput(seq.index, [token], "",
                                        None if status is None else status.finish_reason,
                                        None if status is None else seq.stop_reason)
            else:
                later = after.get(seq.seq_id, 0)
                if later:
                    after[seq.seq_id] = later - 1
                comp = self._token_output(state, req, seq, token, status, result, row,
                                          defer_text, later)
                if status is None and comp.finish_reason is not None:
                    cut.add(seq.seq_id)
            prompt_lps = state.take_prompt_logprobs() if state is not None else None
            if req.n == 1:
                finished = comp.finish_reason is not None
                emit(RequestOutput(req.request_id, req.prompt_token_ids, [comp],
                                   finished, req.num_cached_tokens, None, prompt_lps,
                                   None if result.pooled is None else result.pooled[row]))
                if finished and state is not None:
                    del self._states[req.request_id]
                continue
            hit = touched.get(req.request_id)
            if hit is None:
                out = RequestOutput(req.request_id, req.prompt_token_ids, [comp], False,
                                    req.num_cached_tokens, None, prompt_lps)
                touched[req.request_id] = (req, out)
                emit(out)
            else:
                hit[1].outputs.append(comp)
        for req, out in touched.values():
            if req.is_finished:
                out.finished = True
                self._states.pop(req.request_id, None)
        return outputs

    def _seq_text(self, state: _RequestState, index: int) -> _SeqText | None:
        """The text state of the request's sequence `index` (None without a tokenizer)."""
        text = state.seqs.get(index)
        if text is None and self.tokenizer is not None and index not in state.seqs:
            sp = state.params
            skip = sp.skip_special_tokens
            if self.detokenizer_factory is not None:
                detok = self.detokenizer_factory(state.prompt_token_ids, skip)
            else:
                detok = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, skip,
                                               self._token_cache[skip])
            stop = StopStringBuffer(sp.stop, sp.include_stop_str_in_output) if sp.stop else None
            text = _SeqText(detok, stop, sp.include_stop_str_in_output)
        state.seqs[index] = text
        return text

    def _token_output(self, state: _RequestState, req: Request, seq: Seq, token: int,
                      status: SequenceStatus | None, result: StepResult, row: int,
                      defer_text: bool, later: int = 0) -> CompletionOutput:
        """The delta of one token of a request with text or logprobs."""
        sp = state.params
        stop_reason = seq.stop_reason if status is not None else None
        stopped = status is _STOPPED  # by a stop token (the scheduler's decision)
        text_state = self._seq_text(state, seq.index)
        text: str | None = ""
        if text_state is None:
            pass
        elif defer_text and text_state.stop_buffer is None:
            text = None  # finish_text fills it in
        else:
            piece = text_state.token_text(token, stopped, False)
            if text_state.stop_buffer is None:
                text = piece
            else:
                can_stop = len(seq.token_ids) - later - seq.prompt_len > sp.min_tokens
                text, stop_str = text_state.stop_buffer.feed(piece, can_stop and not stopped)
                if stop_str is not None:
                    if status is None:
                        self.scheduler.stop_sequence(seq.seq_id, stop_str)
                    status, stop_reason = _STOPPED, stop_str
        logprobs = None
        if sp.logprobs is not None:
            logprobs = [logprob_dict(result, row, token, sp.logprobs)]
        if status is None:
            comp = CompletionOutput(seq.index, [token], text or "", None, None, logprobs)
        else:
            if text is not None and text_state is not None and not isinstance(stop_reason, str):
                if self._text_todo:
                    self.finish_text()  # this sequence's earlier tokens come first
                text += text_state.flush()
            comp = CompletionOutput(seq.index, [token], text or "", status.finish_reason,
                                    stop_reason, [] if logprobs is None and sp.logprobs is not None
                                    else logprobs)
        if text is None:
            self._text_todo.append((comp, state))
        return comp

    def _early_output(self, req: Request, seq: Seq) -> RequestOutput:
        """The delta of a sequence finished without a token (the cache could not hold it)."""
        state = self._states.get(req.request_id)
        text = ""
        want_lp = req.sampling_params.logprobs is not None
        prompt_lps = None
        if state is not None:
            prompt_lps = state.take_prompt_logprobs()
            text_state = self._seq_text(state, seq.index)
            if text_state is not None:
                if self._text_todo:
                    self.finish_text()  # this sequence's earlier tokens come first
                text = text_state.flush()
            if req.is_finished:
                del self._states[req.request_id]
        comp = CompletionOutput(seq.index, [], text, seq.status.finish_reason, None,
                                [] if want_lp else None)
        return RequestOutput(req.request_id, req.prompt_token_ids, [comp], req.is_finished,
                             req.num_cached_tokens, None, prompt_lps)

    def _absorb_prompt(self, pl: PromptLogprobs) -> None:
        """Fill the requests' prompt logprobs from one step's (see the module docstring)."""
        states_get = self._states.get
        lps, ranks = pl.logprobs.tolist(), pl.ranks.tolist()
        top_ids, top_lps = pl.top_token_ids.tolist(), pl.top_logprobs.tolist()
        decode = self._decode_token
        m = 0
        for rid, start, count in zip(pl.request_ids, pl.starts.tolist(), pl.counts.tolist()):
            state = states_get(rid)
            out = None if state is None else state.prompt_logprobs
            if out is not None:
                k = state.params.prompt_logprobs
                prompt = state.prompt_token_ids
                for i in range(m, m + count):
                    pos = start + i - m
                    if out[pos] is not None:
                        continue  # a recomputed chunk
                    token = prompt[pos]
                    entry = {token: Logprob(lps[i], ranks[i], decode(token))}
                    for r, (tid, value) in enumerate(zip(top_ids[i][:k], top_lps[i][:k])):
                        if tid not in entry:
                            entry[tid] = Logprob(value, r + 1, decode(tid))
                    out[pos] = entry
            m += count

    def _decode_token(self, token: int) -> str | None:
        """A token's own text (None without a tokenizer), cached."""
        if self.tokenizer is None:
            return None
        text = self._decoded.get(token)
        if text is None:
            text = self._decoded[token] = self.tokenizer.decode([token])
        return text

    def finish_text(self) -> None:
        """Fill in the text process(defer_text=True) left out, in token order."""
        todo = self._text_todo
        seq_text = self._seq_text
        for comp, state in todo:
            # a deferred sequence has no stop strings: "stop" means a stop token
            reason = comp.finish_reason
            comp.text = seq_text(state, comp.index).token_text(
                comp.token_ids[0], reason == "stop", reason is not None)
        todo.clear()


def logprob_dict(result: StepResult, row: int, token: int, k: int) -> dict[int, float]:
    """vLLM's per-token shape: {chosen id: logprob, top-k ids: logprobs}."""
    if result.logprobs is None:
        raise ValueError(f"StepResult of step {result.step_id} has no logprobs but a sequence "
                         "asked for them")
    lp = {token: float(result.logprobs[row])}
    if k:
        if (result.top_token_ids is None or result.top_logprobs is None
                or result.top_token_ids.shape[1] < k):
            raise ValueError(f"StepResult of step {result.step_id} lacks the top-{k} logprobs "
                             "a sequence asked for")
        for tid, tlp in zip(result.top_token_ids[row, :k].tolist(),
                            result.top_logprobs[row, :k].tolist()):
            lp.setdefault(tid, tlp)
    return lp
