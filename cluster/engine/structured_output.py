"""Structured outputs: constraints compiled into xgrammar grammars, one matcher per constrained
sequence, and the token bitmask of a step's constrained rows.

The engine's side of xgrammar lives here and in grammar.py (what a constraint means as a
grammar), imported lazily: an engine that never sees a constrained request never loads it,
nor builds its tokenizer info.

- Compiling: `compile(spec)` turns a `StructuredOutputsParams` into a compiled grammar, once
  per distinct constraint (an LRU cache keyed by the spec's canonical JSON); `compile_async`
  does it off the event loop. A constraint that does not compile, or that uses a JSON Schema
  keyword xgrammar would silently not enforce, is a `ValueError` naming the problem.
- Matching: a request's sequences (n > 1: one matcher per sample) are learnt from the plans'
  `new_seqs`; `mark(plan)` sets the plan's `constrained_rows`, `bitmask(plan)` fills their
  rows, `on_result(plan, result, outputs)` advances the matchers by the step's tokens and
  drops the finished ones.

Invariants: a live sequence's matcher has accepted exactly its output tokens, in order (the
scheduler never discards a sampled token of a live sequence: recompute preemption recomputes
KV for the tokens it keeps; `rollback` exists for a caller that does discard). A matcher that
has accepted a stop token allows only stop tokens (ignore_eos and min_tokens keep such a
sequence going: it can only repeat EOS, whose text is empty). A row whose sequence has no
matcher any more (finished or aborted while its step was in flight) is all ones.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from cluster.engine.grammar import build_grammar, xgrammar_message
from scheduler.plan import StepPlan, StepResult
from scheduler.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept (a JSON schema's is ~0.1-1 MB).
GRAMMAR_CACHE_SIZE = 256
# A constraint that takes longer than this to compile is refused; its compile thread (one per
# compile, so a stuck one blocks no other) runs on, but nobody waits for it.
COMPILE_TIMEOUT_S = 30.0


class StructuredOutputManager:
    """One engine's grammars and matchers (see the module docstring).

    `vocab_size` is the model's (its logits' width, 151,936 for Qwen3), which may exceed the
    tokenizer's; ids past the tokenizer's are never allowed. `eos_token_ids` end a grammar.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 compile_timeout_s: float = COMPILE_TIMEOUT_S,
                 disable_any_whitespace: bool = False) -> None:
        self.tokenizer = tokenizer
        # the server's default (EngineConfig.disable_any_whitespace): set on every spec
        self.disable_any_whitespace = disable_any_whitespace
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.compile_timeout_s = compile_timeout_s
        self._lock = threading.Lock()  # the cache and the compiles in flight
        self._compiler_lock = threading.Lock()
        self._compiler: Any = None
        self._grammars: OrderedDict[str, Any] = OrderedDict()
        self._compiling: dict[str, concurrent.futures.Future] = {}
        # request id -> its grammar and its samples' matchers and sequence ids
        self._requests: dict[str, _Constrained] = {}
        self._by_seq: dict[int, Any] = {}  # seq_id -> matcher
        self._seq_array: np.ndarray | None = None  # the keys of _by_seq (None: stale)
        self._buffer = np.zeros((0, self.words), dtype=np.int32)
        self._stop_row: np.ndarray | None = None
        self._batch: Any = None
        # Time the engine's hooks took (mark, bitmask, on_result): the host's share of a step.
        self.hook_seconds = 0.0

    @property
    def active(self) -> bool:
        """Whether any request is constrained (the engine skips every hook otherwise)."""
        return bool(self._requests)

    # ----- compiling ------------------------------------------------------------------------

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec` (cached); ValueError when it cannot be compiled."""
        try:
            return self._future(spec).result(self.compile_timeout_s)
        except TimeoutError:
            raise self._timeout(spec) from None

    async def compile_async(self, spec: StructuredOutputsParams) -> None:
        """`compile`, awaited without blocking the event loop (the result stays cached). The
        compile is shared: a caller that gives up (timeout, cancelled) leaves it to the others."""
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._future(spec))),
                                   self.compile_timeout_s)
        except TimeoutError:
            raise self._timeout(spec) from None

    def _timeout(self, spec: StructuredOutputsParams) -> ValueError:
        return ValueError(f"the {spec.kind} constraint did not compile within "
                          f"{self.compile_timeout_s:g} s; simplify it")

    def _future(self, spec: StructuredOutputsParams) -> concurrent.futures.Future:
        if self.disable_any_whitespace:  # every caller (compile, add_request) comes through here
            spec.disable_any_whitespace = True
        key = spec.key()
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(grammar)
                return done
            future = self._compiling.get(key)
            if future is None:
                future = self._compiling[key] = concurrent.futures.Future()
                threading.Thread(target=self._compile, args=(key, spec, future),
                                 name="grammar-compile", daemon=True).start()
            return future

    def _compile(self, key: str, spec: StructuredOutputsParams,
                 future: concurrent.futures.Future) -> None:
        """(On its own compile thread.) The grammar, or the ValueError, into `future`."""
        grammar = error = None
        try:
            grammar = self._get_compiler().compile_grammar(build_grammar(spec))
        except ValueError as e:
            error = e
        except Exception as e:  # noqa: BLE001 — xgrammar reports a bad constraint as RuntimeError
            error = ValueError(f"the {spec.kind} constraint does not compile: "
                               f"{xgrammar_message(e)}")
        with self._lock:
            self._compiling.pop(key, None)
            if grammar is not None:
                self._grammars[key] = grammar
                while len(self._grammars) > GRAMMAR_CACHE_SIZE:
                    self._grammars.popitem(last=False)
        if error is None:
            future.set_result(grammar)
        else:
            future.set_exception(error)

    def _get_compiler(self) -> Any:
        """(On a compile thread: building the tokenizer info takes about a second.)"""
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.eos_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    # ----- requests and their sequences -----------------------------------------------------

    def add_request(self, request_id: str, spec: StructuredOutputsParams) -> None:
        """Constrain `request_id`'s samples by `spec` (compiled now unless cached)."""
        self._requests[request_id] = _Constrained(self.compile(spec))

    def add_seq(self, seq_id: int, request_id: str, index: int) -> None:
        """Sequence `seq_id` is sample `index` of `request_id` (a no-op for an unconstrained
        request); a sample keeps its matcher across preemptions."""
        req = self._requests.get(request_id)
        if req is None:
            return
        matcher = req.matchers.get(index)
        if matcher is None:
            import xgrammar as xgr

            matcher = req.matchers[index] = xgr.GrammarMatcher(req.grammar)
        req.seq_ids[index] = seq_id
        if self._by_seq.get(seq_id) is not matcher:
            self._by_seq[seq_id] = matcher
            self._seq_array = None

    def finish_seq(self, request_id: str, index: int) -> None:
        """Sample `index` of the request finished: its matcher goes."""
        req = self._requests.get(request_id)
        if req is None:
            return
        req.matchers.pop(index, None)
        seq_id = req.seq_ids.pop(index, None)
        if seq_id is not None and self._by_seq.pop(seq_id, None) is not None:
            self._seq_array = None

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: drop every matcher of it."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for seq_id in req.seq_ids.values():
            self._by_seq.pop(seq_id, None)
        self._seq_array = None

    # ----- matching -------------------------------------------------------------------------

    def accept(self, seq_id: int, tokens: Iterable[int]) -> bool:
        """Advance the sequence's matcher by `tokens`; False (and logged) for a token the
        grammar refuses, which is then skipped. A sequence without a matcher accepts all."""
        matcher = self._by_seq.get(seq_id)
        if matcher is None:
            return True
        ok = True
        for token in tokens:
            if matcher.is_terminated():
                continue  # only stop tokens can follow (see fill)
            if not matcher.accept_token(int(token)):
                logger.error("grammar refused token %d of sequence %d (the bitmask allowed it)",
                             token, seq_id)
                ok = False
        return ok

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        """Undo the last `num_tokens` tokens the sequence's matcher accepted."""
        matcher = self._by_seq.get(seq_id)
        if matcher is not None and num_tokens > 0:
            matcher.rollback(num_tokens)

    def fill(self, seq_ids: Iterable[int]) -> np.ndarray:
        """The next-token bitmask of each sequence: int32 [R, ceil(vocab / 32)], bit j % 32 of
        word j // 32 set = token j allowed. A view of a buffer the next call overwrites."""
        seq_ids = list(seq_ids)
        rows = len(seq_ids)
        if self._buffer.shape[0] < rows:
            self._buffer = np.zeros((max(rows, 2 * self._buffer.shape[0]), self.words),
                                    dtype=np.int32)
        out = self._buffer[:rows]
        matchers, indices = [], []
        for i, seq_id in enumerate(seq_ids):
            matcher = self._by_seq.get(seq_id)
            if matcher is None:
                out[i] = -1
            elif matcher.is_terminated():
                out[i] = self._stop_mask()
            else:
                matchers.append(matcher)
                indices.append(i)
        if matchers:
            if self._batch is None:
                import xgrammar as xgr

                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(matchers, out, indices)
        return out

    def _stop_mask(self) -> np.ndarray:
        if self._stop_row is None:
            row = np.zeros(self.words, dtype=np.uint32)
            for t in self.eos_token_ids:
                row[t >> 5] |= np.uint32(1 << (t & 31))
            self._stop_row = row.view(np.int32)
        return self._stop_row

    # ----- the engine's hooks ---------------------------------------------------------------

    def mark(self, plan: StepPlan) -> None:
        """Learn the plan's new sequences and set its `constrained_rows` (indices among its
        sampled rows whose sequence has a matcher)."""
        start = time.perf_counter()
        self._mark(plan)
        self.hook_seconds += time.perf_counter() - start

    def _mark(self, plan: StepPlan) -> None:
        for new in plan.new_seqs:
            self.add_seq(new.seq_id, new.request_id, new.seq_index)
        if not self._by_seq:
            return
        if self._seq_array is None:
            self._seq_array = np.fromiter(self._by_seq, dtype=np.int64, count=len(self._by_seq))
        sampled = plan.seq_ids[plan.do_sample]
        plan.constrained_rows = np.flatnonzero(np.isin(sampled, self._seq_array))

    def bitmask(self, plan: StepPlan) -> np.ndarray:
        """The bitmask of the plan's constrained rows, in `constrained_rows` order, for
        `Executor.provide_bitmask`. Every plan before it must have been applied."""
        start = time.perf_counter()
        sampled = plan.seq_ids[plan.do_sample]
        mask = self.fill(sampled[plan.constrained_rows].tolist())
        self.hook_seconds += time.perf_counter() - start
        return mask

    def on_result(self, plan: StepPlan, result: StepResult | None, outputs: Iterable[Any]) -> None:
        """After the output processor turned `plan` and `result` into `outputs`: the constrained
        rows' tokens advance their matchers, then finished samples and requests let go."""
        start = time.perf_counter()
        self._on_result(plan, result, outputs)
        self.hook_seconds += time.perf_counter() - start

    def _on_result(self, plan: StepPlan, result: StepResult | None,
                   outputs: Iterable[Any]) -> None:
        if result is not None and plan.num_constrained:
            rows = plan.constrained_rows
            for seq_id, token in zip(result.seq_ids[rows].tolist(),
                                     result.token_ids[rows].tolist()):
                self.accept(seq_id, (token,))
        requests = self._requests
        for out in outputs:
            if out.request_id not in requests:
                continue
            if out.finished:
                self.release(out.request_id)
                continue
            for c in out.outputs:
                if c.finish_reason is not None:
                    self.finish_seq(out.request_id, c.index)


class _Constrained:
    __slots__ = ("grammar", "matchers", "seq_ids")

    def __init__(self, grammar: Any) -> None:
        self.grammar = grammar
        self.matchers: dict[int, Any] = {}  # sample index -> matcher
        self.seq_ids: dict[int, int] = {}  # sample index -> seq id
