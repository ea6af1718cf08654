"""A fake model and a fake worker that executes StepPlans exactly as a real worker would.

The worker keeps a fake KV cache: one int per slot, holding the token whose KV it is. It
applies drops, swaps, copy-on-write copies and table diffs in the order plan.py gives, writes
every computed token at its slot, and when a sequence samples it "attends" by reading its
whole context back from the cache, so any wrong block id, lost swap, missing copy or bad
prefix hit changes the sampled tokens. The next token is a deterministic function of the
context read and the sequence index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cluster.engine.output_processor import OutputProcessor
from kvcache import KVCacheManager
from scheduler import (
    RequestOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    StepResult,
)
from scheduler.plan import PENDING_TOKEN
from scheduler.speculative import SpeculativeConfig

VOCAB = 500
EOS = 1


def next_token(context: list[int], seq_index: int) -> int:
    """The fake model: a hash of the last few tokens, the length and the sample index."""
    x = len(context) * 1_000_003 + seq_index * 7919
    for t in context[-4:]:
        x = (x * 131 + t + 17) % 2_147_483_647
    x = (x * 2_654_435_761) % 2_147_483_647
    return EOS if x % 37 == 0 else 2 + x % (VOCAB - 2)


def reference_tokens(prompt: list[int], sp: SamplingParams, index: int, max_model_len: int,
                     eos_ids: frozenset[int] = frozenset({EOS})) -> list[int]:
    """What one sequence generates with unlimited memory (token stops only, no stop strings)."""
    stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids))
    limit = max_model_len - len(prompt)
    max_out = limit if sp.max_tokens is None else min(sp.max_tokens, limit)
    out: list[int] = []
    while True:
        tok = next_token(prompt + out, index)
        out.append(tok)
        if (len(out) > sp.min_tokens and tok in stops) or len(out) >= max_out:
            return out


class ByteTokenizer:
    """Byte-level BPE in miniature: ids < 256 are single bytes (so multi-byte characters span
    tokens), 256.. are ASCII words, 1 is the special <eos>. Tokens are bytes as latin-1 text."""

    EOS = 1
    all_special_ids = [EOS]

    def __len__(self) -> int:
        return 600

    def _piece(self, i: int) -> str:
        if i == self.EOS:
            return "<eos>"
        return bytes([i]).decode("latin-1") if i < 256 else f" w{i}"

    def convert_ids_to_tokens(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        return [self._piece(i) for i in ids if not (skip_special_tokens and i == self.EOS)]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out, buf = [], []
        for t in tokens:
            if t == "<eos>":
                out.append(bytes(buf).decode("utf-8", errors="replace"))
                out.append(t)
                buf = []
            else:
                buf.extend(t.encode("latin-1"))
        out.append(bytes(buf).decode("utf-8", errors="replace"))
        return "".join(out)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.convert_tokens_to_string(self.convert_ids_to_tokens(ids, skip_special_tokens))

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


@dataclass
class _WorkerSeq:
    table: list[int]
    history: list[int]
    seq_index: int
    prompt_len: int
    sampling_params: SamplingParams
    last_sampled: tuple[int, int] | None = None  # (step id, token) of its latest sample


class FakeWorker:
    """Executes plans and checks the protocol; raises AssertionError on any violation."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 num_offload_blocks: int = 0) -> None:
        self.bs = block_size
        self.gpu = np.full((num_gpu_blocks, block_size), -1, dtype=np.int64)
        self.cpu = np.full((max(num_cpu_blocks, 1), block_size), -1, dtype=np.int64)
        self.tier = np.full((max(num_offload_blocks, 1), block_size), -1, dtype=np.int64)
        self.num_offloaded = self.num_loaded = 0
        self.seqs: dict[int, _WorkerSeq] = {}
        self.last_step = 0
        self.num_sampled = 0
        self.num_pending_filled = 0
        self.num_verified = 0  # verify rows executed (speculative decoding)

    def execute(self, plan: StepPlan) -> StepResult:
        assert plan.step_id > self.last_step, "step ids must increase"
        self.last_step = plan.step_id
        b = plan.num_seqs
        assert plan.seq_ids.dtype == np.int64 and plan.input_ids.dtype == np.int64
        assert plan.query_lens.dtype == np.int32 and plan.start_pos.dtype == np.int32
        assert plan.do_sample.dtype == np.bool_
        assert len(plan.query_lens) == len(plan.start_pos) == len(plan.do_sample) == b
        assert plan.input_ids.size == int(plan.query_lens.sum())
        assert len(set(plan.seq_ids.tolist())) == b, "a sequence appears twice in the batch"
        assert (plan.query_lens >= 1).all()
        # Decodes (one token that samples) come first.
        is_decode = (plan.query_lens == 1) & plan.do_sample
        if b:
            first_chunk = int(np.argmin(is_decode)) if not is_decode.all() else b
            assert not is_decode[first_chunk:].any(), "a decode follows a prefill chunk"
        for arr in (plan.swap_out, plan.swap_in, plan.copies, plan.offload, plan.load):
            assert arr.dtype == np.int64 and arr.ndim == 2 and arr.shape[1] == 2
        # 1. drops
        for sid in plan.dropped_seq_ids:
            assert sid in self.seqs, f"drop of seq {sid} the worker does not hold"
            del self.seqs[sid]
        # 2. offloads, swaps, loads and copies
        for gpu, tier in plan.offload.tolist():  # in order: a later pair may reuse a tier block
            assert (self.gpu[gpu] >= 0).all(), f"offload of GPU block {gpu}, never written"
            self.tier[tier] = self.gpu[gpu]
            self.num_offloaded += 1
        if len(plan.swap_out):
            assert len(set(plan.swap_out[:, 1].tolist())) == len(plan.swap_out)
            self.cpu[plan.swap_out[:, 1]] = self.gpu[plan.swap_out[:, 0]]
        if len(plan.swap_in):
            assert len(set(plan.swap_in[:, 1].tolist())) == len(plan.swap_in)
            self.gpu[plan.swap_in[:, 1]] = self.cpu[plan.swap_in[:, 0]]
        if len(plan.load):
            assert len(set(plan.load[:, 1].tolist())) == len(plan.load)
            self.gpu[plan.load[:, 1]] = self.tier[plan.load[:, 0]]
            self.num_loaded += len(plan.load)
        for src, dst in plan.copies.tolist():
            self.gpu[dst] = self.gpu[src]
        # 3. state
        for ns in plan.new_seqs:
            assert ns.seq_id not in self.seqs, f"NewSeq for seq {ns.seq_id} already held"
            assert isinstance(ns.sampling_params, SamplingParams)
            self.seqs[ns.seq_id] = _WorkerSeq(list(ns.block_table), list(ns.computed_token_ids),
                                              ns.seq_index, ns.prompt_len, ns.sampling_params)
        for sid, ids in plan.appended_blocks.items():
            assert sid in self.seqs, f"appended blocks for unknown seq {sid}"
            self.seqs[sid].table.extend(ids)
        for sid, table in plan.replaced_tables.items():
            assert sid in self.seqs, f"replaced table for unknown seq {sid}"
            self.seqs[sid].table = list(table)
        # 4. forward: write the whole batch's KV, then read contexts back.
        off = 0
        ids = plan.input_ids.tolist()
        for sid, q, start in zip(plan.seq_ids.tolist(), plan.query_lens.tolist(),
                                 plan.start_pos.tolist()):
            st = self.seqs.get(sid)
            assert st is not None, f"seq {sid} scheduled without state"
            assert start == len(st.history), (
                f"seq {sid}: start_pos {start} but the worker has {len(st.history)} tokens")
            assert len(st.table) * self.bs >= start + q, f"seq {sid}: table too short"
            for p in range(start, start + q):
                token = ids[off]
                if token == PENDING_TOKEN:
                    # Async scheduling: the token this worker sampled for it in the plan before.
                    assert q == 1, f"seq {sid}: a pending token in a chunk of {q}"
                    assert st.last_sampled is not None and \
                        st.last_sampled[0] == plan.step_id - 1, (
                            f"seq {sid}: pending token in step {plan.step_id}, but its last "
                            f"sample was {st.last_sampled}")
                    token = st.last_sampled[1]
                    self.num_pending_filled += 1
                assert token >= 0, f"seq {sid}: token id {token}"
                self.gpu[st.table[p // self.bs], p % self.bs] = token
                st.history.append(token)
                off += 1
        out_ids, out_tokens, num_tokens = [], [], []
        drafts = ([0] * b if plan.num_draft_tokens is None
                  else plan.num_draft_tokens.tolist())
        for sid, sample, d in zip(plan.seq_ids.tolist(), plan.do_sample.tolist(), drafts):
            if not sample:
                continue
            st = self.seqs[sid]
            n = len(st.history)
            context = [int(self.gpu[st.table[p // self.bs], p % self.bs]) for p in range(n)]
            assert context == st.history, f"seq {sid}: KV cache content differs from its tokens"
            out_ids.append(sid)
            # a verify row (d proposals): the model's token after each of its last d + 1
            # positions, kept while the proposal agrees (greedy acceptance); its rejected
            # tokens leave the worker's history (their KV is stale, written over later)
            kept = []
            for j in range(d + 1):
                kept.append(next_token(context[:n - d + j], st.seq_index))
                if j < d and kept[-1] != context[n - d + j]:
                    break
            out_tokens += kept + [0] * (d + 1 - len(kept))
            num_tokens.append(len(kept))
            del st.history[n - d + len(kept) - 1:]
            self.num_verified += d > 0
            st.last_sampled = (plan.step_id, kept[-1])
        self.num_sampled += len(out_ids)
        k = max((self.seqs[s].sampling_params.logprobs or 0 for s in out_ids), default=0)
        want_lp = any(self.seqs[s].sampling_params.logprobs is not None for s in out_ids)
        s = len(out_tokens)
        return StepResult(
            num_tokens=(None if plan.num_draft_tokens is None
                        else np.array(num_tokens, dtype=np.int32)),
            step_id=plan.step_id,
            seq_ids=np.array(out_ids, dtype=np.int64),
            token_ids=np.array(out_tokens, dtype=np.int64),
            logprobs=-np.arange(1, s + 1, dtype=np.float32) / 8 if want_lp else None,
            top_token_ids=(np.arange(s * k, dtype=np.int64).reshape(s, k) + 100
                           if want_lp else None),
            top_logprobs=(-np.arange(s * k, dtype=np.float32).reshape(s, k) / 4
                          if want_lp else None),
        )


@dataclass
class Collected:
    """Everything the scheduler emitted for one sequence."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_logprobs: int = 0


def collect(outputs: list[RequestOutput], into: dict[tuple[str, int], Collected],
            finished: set[str]) -> None:
    for out in outputs:
        assert out.request_id not in finished, f"output for finished request {out.request_id}"
        for comp in out.outputs:
            c = into.setdefault((out.request_id, comp.index), Collected())
            assert c.finish_reason is None, f"{out.request_id}/{comp.index} emitted after finish"
            c.token_ids.extend(comp.token_ids)
            c.text += comp.text
            c.finish_reason = comp.finish_reason
            c.stop_reason = comp.stop_reason
            if comp.logprobs is not None:
                c.num_logprobs += len(comp.logprobs)
        if out.finished:
            finished.add(out.request_id)


class Core:
    """A Scheduler and its OutputProcessor, driven as LLMEngine drives them, under the names
    the tests use: add_request goes to both, apply_result is the scheduler's outcome made into
    RequestOutputs, abort and finish_text are the processor's. Anything else is the
    scheduler's (`core.lane`, `core.queues`, `core.stats()`...)."""

    def __init__(self, sched: Scheduler, tokenizer: object = None,
                 detokenizer_factory: object = None) -> None:
        self.sched = sched
        self.outputs = OutputProcessor(sched, tokenizer, detokenizer_factory)

    def add_request(self, request_id: str, prompt_token_ids: list[int], sp: SamplingParams,
                    **kw: object) -> None:
        self.outputs.validate(sp)
        self.sched.add_request(request_id, prompt_token_ids, sp, **kw)
        self.outputs.add_request(request_id, prompt_token_ids, sp)

    def apply_result(self, plan: StepPlan, result: StepResult | None,
                     defer_text: bool = False) -> list[RequestOutput]:
        return self.outputs.process(self.sched.apply_result(plan, result), defer_text)

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.outputs.abort(request_id)

    def finish_text(self) -> None:
        self.outputs.finish_text()

    def __getattr__(self, name: str) -> object:
        return getattr(self.sched, name)


def make(num_gpu_blocks: int = 16, num_cpu_blocks: int = 0, block_size: int = 4,
         tokenizer: object = None, watermark: float = 0.0, enable_prefix_caching: bool = True,
         lane_min_running: int = 1, num_offload_blocks: int = 0,
         speculative: SpeculativeConfig | None = None, **config: object
         ) -> tuple[Core, KVCacheManager, FakeWorker]:
    """A scheduler with its output processor, its KV cache and a fake worker.
    lane_min_running=1 lets the decode lane run at these tests' small sizes (the engine's
    default is LANE_MIN_RUNNING)."""
    kv = KVCacheManager(num_gpu_blocks, num_cpu_blocks, block_size,
                        enable_prefix_caching=enable_prefix_caching, watermark=watermark,
                        num_offload_blocks=num_offload_blocks)
    sched = Scheduler(SchedulerConfig(**config), kv, eos_token_ids=[EOS],
                      vocab_size=len(tokenizer) if tokenizer is not None else None,
                      speculative=speculative)
    if speculative is None and not sched.inflight.disjoint:  # (micro-batches: no lane)
        sched.lane.min_running = lane_min_running
    return Core(sched, tokenizer), kv, FakeWorker(num_gpu_blocks, num_cpu_blocks, block_size,
                                                  num_offload_blocks)


def check_consistency(sched: Core, kv: KVCacheManager, worker: FakeWorker) -> None:
    """Scheduler, KV manager and worker agree on every live sequence."""
    kv.check_invariants()
    sched.check_lane()
    for req in sched.requests.values():
        for seq in req.seqs:
            if seq.status.is_finished:
                assert not kv.has_seq(seq.seq_id)
                continue
            if seq.on_worker:
                st = worker.seqs[seq.seq_id]
                table = kv.block_table(seq.seq_id)
                # a rollback freed blocks: the next plan shrinks the worker's table
                shrunk = sched.spec is not None and any(s is seq for _, s in sched.spec.shrunk)
                assert (st.table[:len(table)] if shrunk else st.table) == table, \
                    f"seq {seq.seq_id} table differs"
                # Tokens in flight (async scheduling) are on the worker, not yet in token_ids.
                assert len(st.history) == seq.num_computed
                known = min(seq.num_computed, len(seq.token_ids))
                assert st.history[:known] == seq.token_ids[:known]
            else:
                assert seq.seq_id not in worker.seqs or seq.seq_id in sched.queues.drops
            if kv.has_seq(seq.seq_id):
                assert kv.num_slots(seq.seq_id) == seq.num_computed


def step(sched: Core, worker: FakeWorker) -> tuple[StepPlan, list[RequestOutput]]:
    plan = sched.schedule()
    result = worker.execute(plan)
    return plan, sched.apply_result(plan, result)


class Pipeline:
    """Async scheduling as the engine drives it: step N+1 is scheduled (and, the fake worker
    being synchronous, executed) before step N's result is applied; with `depth` > 2 (micro-
    batches) that many plans are in flight."""

    def __init__(self, sched: Core, worker: FakeWorker, depth: int = 2) -> None:
        self.sched = sched
        self.worker = worker
        self.depth = depth
        self.inflight: list[tuple[StepPlan, StepResult]] = []

    def launch(self) -> StepPlan:
        plan = self.sched.schedule()
        self.inflight.append((plan, self.worker.execute(plan)))
        return plan

    def step(self) -> list[RequestOutput]:
        """Keep `depth` plans in flight while requests remain; apply the oldest."""
        if not self.inflight:
            self.launch()
        while len(self.inflight) < self.depth and self.sched.has_unfinished():
            self.launch()
        plan, result = self.inflight.pop(0)
        return self.sched.apply_result(plan, result)

    def busy(self) -> bool:
        return self.sched.has_unfinished() or bool(self.inflight)


def run_to_completion(sched: Core, kv: KVCacheManager, worker: FakeWorker,
                      max_steps: int = 10_000, pipelined: bool = False,
                      depth: int = 2) -> dict[tuple[str, int], Collected]:
    got: dict[tuple[str, int], Collected] = {}
    finished: set[str] = set()
    pipe = Pipeline(sched, worker, depth)
    for _ in range(max_steps):
        if not pipe.busy():
            return got
        outs = pipe.step() if pipelined else step(sched, worker)[1]
        collect(outs, got, finished)
        check_consistency(sched, kv, worker)
    raise AssertionError(f"not finished after {max_steps} steps: {sched.requests}")
