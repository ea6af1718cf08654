"""What one sampled token means for its sequence: stop conditions, new text, logprobs.

vLLM's semantics: EOS (unless ignore_eos) and stop_token_ids stop with "stop" (the token is in
token_ids but not in the text, unless include_stop_str_in_output); stop strings stop with "stop"
and cut the text before the string (after it with include_stop_str_in_output); none of these
stop a sequence before it has more than min_tokens outputs (the sampler does not mask them, so
they are ignored instead); max_tokens and max_model_len stop with "length". Checked in that
order, so a stop on the last allowed token reports "stop".
"""

from __future__ import annotations

from scheduler.plan import StepResult
from scheduler.request import Request, Sequence, SequenceStatus


def process_token(req: Request, seq: Sequence, token: int, result: StepResult, row: int,
                  defer_text: bool = False
                  ) -> tuple[SequenceStatus | None, str | None, str | int | None,
                             list[dict[int, float]] | None]:
    """For a token already appended to seq.token_ids: (finished status or None, new text,
    stop reason, logprobs). The caller finishes the sequence.

    With defer_text, a sequence without stop strings (whose text cannot stop it) is not
    detokenized here: the text comes back as None and `token_text` gives it later."""
    sp = req.sampling_params
    num_out = len(seq.token_ids) - seq.prompt_len
    can_stop = num_out > sp.min_tokens
    status = None
    stop_reason: str | int | None = None
    if can_stop and token in req.stop_token_ids:
        status = SequenceStatus.FINISHED_STOPPED
        stop_reason = req.stop_token_ids[token]
    text: str | None = ""
    if defer_text and seq.detokenizer is not None and seq.stop_buffer is None:
        text = None
    elif seq.detokenizer is not None:
        piece = token_text(req, seq, token, status is not None, False)
        if seq.stop_buffer is not None:
            text, stop_str = seq.stop_buffer.feed(piece, can_stop and status is None)
            if stop_str is not None:
                status = SequenceStatus.FINISHED_STOPPED
                stop_reason = stop_str
        else:
            text = piece
    if status is None and num_out >= req.max_output:
        status = SequenceStatus.FINISHED_LENGTH
    logprobs = None
    if sp.logprobs is not None:
        logprobs = [logprob_dict(result, row, token, sp.logprobs)]
    return status, text, stop_reason, logprobs


def token_text(req: Request, seq: Sequence, token: int, stopped: bool, finished: bool) -> str:
    """The text process_token deferred for a sequence without stop strings: the token's own
    (not for a stop token, unless include_stop_str_in_output), then, if the sequence finished,
    what its detokenizer held back. Called in token order, once per deferred token."""
    detok = seq.detokenizer
    text = (detok.step(token)
            if not stopped or req.sampling_params.include_stop_str_in_output else "")
    return text + detok.flush() if finished else text


def flush_text(seq: Sequence) -> str:
    """The text a finishing sequence still holds back (stop-string window, then incomplete
    characters, which come out as U+FFFD exactly as tokenizer.decode shows them)."""
    text = ""
    if seq.stop_buffer is not None:
        text += seq.stop_buffer.flush()
    if seq.detokenizer is not None:
        text += seq.detokenizer.flush()
    return text


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
