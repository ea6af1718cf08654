"""Test helpers for workers/: a tiny plan builder (no scheduler logic), executors that run
Worker ranks in-process or in spawned processes, and the Hugging Face greedy oracle."""

from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from scheduler.plan import NewSeq, StepPlan, StepResult, empty_pairs
from scheduler.sampling_params import SamplingParams
from workers import shm_collectives
from workers.config import WorkerConfig
from workers.cuda_graph import EagerGraph
from workers.distributed import TensorParallelGroup, get_free_port
from workers.worker import Worker

# ------------------------------------------------------------------------------------------
# test models

# Untied LM head, 8 query / 4 KV heads of dim 16, a vocabulary no tp size divides.
SECOND_CONFIG = {
    "vocab_size": 1003, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 3,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,  # inside the small vocabulary
}
# One KV head: with tp = 2 both ranks hold a replica of it.
SINGLE_KV_CONFIG = {
    "vocab_size": 515, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}

# Lengths 5..40 with block_size 16: one to three blocks, chunked by a 24-token budget.
PARITY_PROMPT_LENS = (5, 40, 23, 17)
NUM_GREEDY_TOKENS = 32


def parity_prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(1234)
    return [rng.integers(10, vocab_size, n).tolist() for n in PARITY_PROMPT_LENS]


# ------------------------------------------------------------------------------------------
# plan builder


@dataclass
class _Seq:
    seq_id: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    max_tokens: int
    seq_index: int = 0
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    sent: bool = False
    swapped: list[int] | None = None  # CPU block ids while swapped out
    outputs: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    results: list[tuple[float | None, np.ndarray | None, np.ndarray | None]] = field(
        default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_tokens


class PlanBuilder:
    """Schedules like a minimal engine: decodes first, then prefill chunks within a token budget.

    Blocks come from a FIFO free list and are handed out as sequences grow (NewSeq with the
    first blocks, `appended_blocks` after), so tables interleave across sequences. Blocks are
    ref-counted so forks can share them.
    """

    def __init__(self, block_size: int = 16, num_gpu_blocks: int = 128, num_cpu_blocks: int = 32,
                 token_budget: int = 24) -> None:
        self.block_size = block_size
        self.token_budget = token_budget
        self.free = deque(range(num_gpu_blocks))
        self.free_cpu = deque(range(num_cpu_blocks))
        self.refs: dict[int, int] = {}
        self.seqs: dict[int, _Seq] = {}
        self.order: list[int] = []
        self.next_id = 0
        self.step_id = 0
        self.pending_drops: list[int] = []
        self.pending_swap_out: list[tuple[int, int]] = []
        self.pending_swap_in: list[tuple[int, int]] = []
        self.pending_copies: list[tuple[int, int]] = []
        self.to_swap_in: list[int] = []
        self.forks: list[tuple[int, int]] = []  # (parent, child) to announce next plan

    def add(self, prompt: list[int], params: SamplingParams | None = None,
            max_tokens: int = 8, seq_index: int = 0) -> int:
        sid = self.next_id
        self.next_id += 1
        self.seqs[sid] = _Seq(sid, list(prompt), len(prompt), params or SamplingParams(temperature=0),
                              max_tokens, seq_index)
        self.order.append(sid)
        return sid

    def _alloc(self) -> int:
        b = self.free.popleft()
        self.refs[b] = 1
        return b

    def _release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                self.free.append(b)

    def swap_out(self, sid: int) -> None:
        """Next plan: copy the sequence's blocks to CPU and drop its worker state."""
        s = self.seqs[sid]
        cpu = [self.free_cpu.popleft() for _ in s.blocks]
        self.pending_swap_out += list(zip(s.blocks, cpu))
        self._release(s.blocks)
        s.blocks, s.swapped, s.sent = [], cpu, False
        self.pending_drops.append(sid)

    def swap_in(self, sid: int) -> None:
        """Next plan: bring the sequence back into fresh GPU blocks and resume it."""
        self.to_swap_in.append(sid)

    def fork(self, sid: int, params: SamplingParams | None = None, max_tokens: int | None = None,
             seq_index: int = 1) -> int:
        """A child sharing the parent's full blocks; its partial last block is copied (CoW)."""
        p = self.seqs[sid]
        cid = self.next_id
        self.next_id += 1
        child = _Seq(cid, list(p.tokens), p.prompt_len, params or p.params,
                     max_tokens if max_tokens is not None else p.max_tokens, seq_index,
                     num_computed=p.num_computed, outputs=list(p.outputs))
        full = p.num_computed // self.block_size
        child.blocks = list(p.blocks[:full])
        for b in child.blocks:
            self.refs[b] += 1
        if p.num_computed % self.block_size:
            dst = self._alloc()
            self.pending_copies.append((p.blocks[full], dst))
            child.blocks.append(dst)
        self.seqs[cid] = child
        self.order.append(cid)
        self.forks.append((sid, cid))
        return cid

    def next_plan(self) -> StepPlan | None:
        new_seqs: list[NewSeq] = []
        appended: dict[int, list[int]] = {}
        for sid in self.to_swap_in:
            s = self.seqs[sid]
            s.blocks = [self._alloc() for _ in s.swapped]
            self.pending_swap_in += list(zip(s.swapped, s.blocks))
            self.free_cpu.extend(s.swapped)
            s.swapped = None
        self.to_swap_in = []
        active = [self.seqs[i] for i in self.order
                  if not self.seqs[i].done and self.seqs[i].swapped is None]
        decodes = [s for s in active if s.num_computed >= s.prompt_len]
        prefills = [s for s in active if s.num_computed < s.prompt_len]
        scheduled: list[tuple[_Seq, int]] = [(s, 1) for s in decodes]
        budget = self.token_budget - len(decodes)
        for s in prefills:
            if budget <= 0:
                break
            n = min(s.prompt_len - s.num_computed, budget)
            scheduled.append((s, n))
            budget -= n
        for s, n in scheduled:
            need = -(-(s.num_computed + n) // self.block_size)
            fresh = [self._alloc() for _ in range(need - len(s.blocks))]
            s.blocks += fresh
            if not s.sent:
                new_seqs.append(NewSeq(s.seq_id, f"req-{s.seq_id}", s.seq_index, s.prompt_len,
                                       s.tokens[:s.num_computed], list(s.blocks), s.params))
                s.sent = True
            elif fresh:
                appended[s.seq_id] = fresh
        self.forks = []
        if not scheduled and not self.pending_drops and not len(self.pending_swap_out):
            return None

        def pairs(p: list[tuple[int, int]]) -> np.ndarray:
            return np.array(p, dtype=np.int64).reshape(-1, 2) if p else empty_pairs()

        plan = StepPlan(
            step_id=self.step_id,
            seq_ids=np.array([s.seq_id for s, _ in scheduled], dtype=np.int64),
            query_lens=np.array([n for _, n in scheduled], dtype=np.int32),
            start_pos=np.array([s.num_computed for s, _ in scheduled], dtype=np.int32),
            input_ids=np.array([t for s, n in scheduled
                                for t in s.tokens[s.num_computed:s.num_computed + n]],
                               dtype=np.int64),
            do_sample=np.array([s.num_computed + n == len(s.tokens) for s, n in scheduled],
                               dtype=bool),
            new_seqs=new_seqs, appended_blocks=appended,
            dropped_seq_ids=self.pending_drops,
            swap_out=pairs(self.pending_swap_out), swap_in=pairs(self.pending_swap_in),
            copies=pairs(self.pending_copies))
        self.pending_drops, self.pending_swap_out = [], []
        self.pending_swap_in, self.pending_copies = [], []
        self._scheduled = scheduled
        self.step_id += 1
        return plan

    def apply(self, plan: StepPlan, result: StepResult, logits: np.ndarray | None) -> None:
        sampled = iter(range(len(result.token_ids)))
        for s, n in self._scheduled:
            s.num_computed += n
            if s.num_computed == len(s.tokens):
                i = next(sampled)
                assert int(result.seq_ids[i]) == s.seq_id
                tok = int(result.token_ids[i])
                s.tokens.append(tok)
                s.outputs.append(tok)
                if logits is not None:
                    s.logits.append(logits[i])
                if result.logprobs is not None:
                    s.results.append((float(result.logprobs[i]), result.top_token_ids[i],
                                      result.top_logprobs[i]))
                if s.done:
                    self._release(s.blocks)
                    s.blocks = []
                    self.pending_drops.append(s.seq_id)

    def run(self, executor: Any, max_steps: int = 1000,
            hooks: dict[int, Any] | None = None) -> dict[int, list[int]]:
        """Run until every sequence is done; `hooks[step]` is called with self before that step."""
        for step in range(max_steps):
            if hooks and step in hooks:
                hooks[step](self)
            plan = self.next_plan()
            if plan is None:
                return {sid: s.outputs for sid, s in self.seqs.items()}
            result, logits = executor.execute(plan)
            self.apply(plan, result, logits)
        raise RuntimeError("plan builder did not finish")


def step_plan(step: int, seq_ids: list[int], qlens: list[int], starts: list[int],
              ids: list[int], drafts: list[int] | None = None, **kw: Any) -> StepPlan:
    """A plan whose every sequence samples, from plain lists (`drafts`: proposals per row)."""
    n = len(seq_ids)
    return StepPlan(step, np.array(seq_ids, np.int64), np.array(qlens, np.int32),
                    np.array(starts, np.int32), np.array(ids, np.int64), np.ones(n, bool),
                    num_draft_tokens=None if drafts is None else np.array(drafts, np.int32), **kw)


def same_results(eager: Any, other: Any, plan: StepPlan, atol: float) -> StepResult:
    """Run the plan on both executors; the other's result, after checking that it is eager's
    (tokens, accepted counts, logits)."""
    (want, want_logits), (got, got_logits) = eager.execute(plan), other.execute(plan)
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    if want.num_tokens is not None:
        np.testing.assert_array_equal(got.num_tokens, want.num_tokens)
    np.testing.assert_allclose(got_logits, want_logits, atol=atol, rtol=0)
    return got


# ------------------------------------------------------------------------------------------
# executors


class LocalExecutor:
    """A tp == 1 Worker in this process."""

    def __init__(self, num_gpu_blocks: int = 128, num_cpu_blocks: int = 32,
                 num_offload_blocks: int = 0, **config: Any) -> None:
        self.worker = Worker(WorkerConfig(**config))
        try:
            self.worker.init_distributed()
            self.worker.load_model()
            self.worker.init_cache(num_gpu_blocks, num_cpu_blocks, num_offload_blocks)
        except BaseException:  # (as InProcessExecutor: a failed start frees the device)
            self.worker.shutdown()
            raise

    def kv(self, gpu_ids: list[int], tier_ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """As ProcessGroupExecutor.kv, for the one rank."""
        return [_kv_blocks(self.worker, gpu_ids, tier_ids)]

    def execute(self, plan: StepPlan) -> tuple[StepResult, np.ndarray | None]:
        result, logits = self.worker.execute_with_logits(plan)
        # (a copy: on CPU .cpu() aliases, and a graph's logits buffer is reused next replay)
        return result, (logits.float().cpu().numpy().copy() if logits is not None else None)

    def close(self) -> None:
        self.worker.shutdown()


def _child_main(rank: int, commands: Any, replies: Any) -> None:
    torch.set_num_threads(1)
    worker: Worker | None = None
    graph_steps: list[int] = []
    while True:
        cmd, arg = commands.get()
        try:
            if cmd == "exit":
                if worker is not None:
                    worker.shutdown()
                replies.put(("ok", None))
                return
            if cmd == "init":
                config, num_gpu_blocks, num_cpu_blocks, num_offload_blocks, eager_graphs = arg
                worker = Worker(WorkerConfig(**config, rank=rank))
                worker.init_distributed()
                worker.load_model()
                counts = worker.determine_num_blocks()
                worker.init_cache(num_gpu_blocks, num_cpu_blocks, num_offload_blocks)
                if eager_graphs:  # the graph path on CPU (workers/cuda_graph.py EagerGraph)
                    worker.capture_graphs(EagerGraph)
                graph_steps = log_graph_sizes(worker)
                replies.put(("ok", counts))
            elif cmd == "shutdown":
                worker.shutdown()
                worker = None
                replies.put(("ok", None))
            elif cmd == "execute":
                plan, keep_logits = arg
                result, logits = (worker.execute_with_logits(plan) if keep_logits
                                  else (worker.execute(plan), None))
                replies.put(("ok", (result, logits.float().cpu().numpy() if logits is not None else None)))
            elif cmd == "kv":
                replies.put(("ok", _kv_blocks(worker, *arg)))
            elif cmd == "state":
                runner = worker.model_runner
                replies.put(("ok", {"seqs": sorted(runner.seqs),
                                    "graph_sizes": (None if runner.graph_runner is None
                                                    else sorted(runner.graph_runner.graphs)),
                                    "graph_steps": list(graph_steps),
                                    "num_gpu_blocks": worker.cache_engine.num_gpu_blocks,
                                    "kv_scales": [(a.k_scale.tolist(), a.v_scale.tolist())
                                                  for a in worker.model.attention_layers()]}))
        except Exception:  # report to the test process instead of hanging it
            replies.put(("error", traceback.format_exc()))


def log_graph_sizes(worker: Worker) -> list[int]:
    """The graph size (0: eager) of every non-empty step the worker prepares from now on."""
    runner = worker.model_runner
    sizes: list[int] = []
    prepare = runner.prepare

    def logged(plan: StepPlan) -> Any:
        batch = prepare(plan)
        sizes.append(batch.graph_size)
        return batch

    runner.prepare = logged
    return sizes


def _kv_blocks(worker: Worker, gpu_ids: list[int], tier_ids: list[int]
               ) -> tuple[np.ndarray, np.ndarray]:
    cache = worker.cache_engine
    if cache.gpu_cache.is_cuda:
        torch.cuda.synchronize()  # the tier is written on the copy stream
    return (cache.gpu_cache[:, :, gpu_ids].cpu().numpy().copy(),
            cache.offload_cache[tier_ids].numpy().copy())


class ProcessGroupExecutor:
    """`world_size` Worker ranks in spawned processes, driven like the engine drives Ray actors.

    Spawned once and reused: `init(...)` (re)builds the workers on a fresh port, as
    `pipeline_parallel_size` stages of world_size / pp tensor-parallel ranks (default one).
    """

    def __init__(self, world_size: int = 2, timeout: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.output_rank = 0  # the last stage's first rank (set by init)
        self.timeout = timeout
        self.commands = [ctx.Queue() for _ in range(world_size)]
        self.replies = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_child_main, args=(r, self.commands[r], self.replies[r]),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def _call(self, cmd: str, arg: Any = None) -> list[Any]:
        for q in self.commands:
            q.put((cmd, arg))
        out = []
        for r, q in enumerate(self.replies):
            try:
                status, value = q.get(timeout=self.timeout)
            except queue.Empty:
                raise RuntimeError(f"rank {r} did not answer {cmd!r} in {self.timeout} s") from None
            if status == "error":
                raise RuntimeError(f"rank {r} failed on {cmd!r}:\n{value}")
            out.append(value)
        return out

    def init(self, num_gpu_blocks: int = 128, num_cpu_blocks: int = 32,
             num_offload_blocks: int = 0, pipeline_parallel_size: int = 1,
             eager_graphs: bool = False, **config: Any) -> list[tuple[int, int, int]]:
        """`eager_graphs`: every rank also captures EagerGraph graphs (the graph path on CPU)."""
        tp = self.world_size // pipeline_parallel_size
        config = dict(config, tensor_parallel_size=tp,
                      pipeline_parallel_size=pipeline_parallel_size,
                      dist_init_method=f"tcp://127.0.0.1:{get_free_port()}")
        self.output_rank = (pipeline_parallel_size - 1) * tp
        return self._call("init", (config, num_gpu_blocks, num_cpu_blocks, num_offload_blocks,
                                   eager_graphs))

    def kv(self, gpu_ids: list[int], tier_ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per rank: its GPU blocks gpu_ids ([2, layers, n, ...]) and offload-tier blocks
        tier_ids ([n, 2, layers, ...]), copied out."""
        return self._call("kv", (gpu_ids, tier_ids))

    def shutdown_workers(self) -> None:
        self._call("shutdown")

    def execute(self, plan: StepPlan, keep_logits: bool = True
                ) -> tuple[StepResult, np.ndarray | None]:
        """The output rank's result and (with `keep_logits`) logits; without, a step of plain
        greedy rows samples over the vocabulary shards (workers/sampler.py)."""
        replies = self._call("execute", (plan, keep_logits))
        for rank, other in enumerate(replies):
            if rank != self.output_rank:
                assert other == (None, None), "only the output rank returns a result"
        return replies[self.output_rank]

    def state(self) -> list[dict[str, Any]]:
        return self._call("state")

    def close(self) -> None:
        try:
            self._call("exit")
        finally:
            for p in self.procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()


# ------------------------------------------------------------------------------------------
# Hugging Face oracle


def hf_greedy(model_dir: str, prompts: list[list[int]], num_tokens: int,
              prepare: Callable[[torch.nn.Module], None] | None = None
              ) -> list[tuple[list[int], list[np.ndarray]]]:
    """Per prompt: transformers' greedy tokens and the logits each was chosen from (fp32, CPU);
    `prepare(model)` may change the loaded model first (hooks)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    if prepare is not None:
        prepare(model)
    # transformers 5.24 renamed the KV cache argument and output `past_key_values` -> `cache`
    cache = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = []
    with torch.no_grad():
        for prompt in prompts:
            res = model(torch.tensor([prompt]), use_cache=True)
            tokens, logits = [], []
            for _ in range(num_tokens):
                last = res.logits[0, -1]
                tok = int(last.argmax())
                tokens.append(tok)
                logits.append(last.numpy().copy())
                res = model(torch.tensor([[tok]]), **{cache: getattr(res, cache)}, use_cache=True)
            out.append((tokens, logits))
    return out


def _rank_main(rank: int, world: int, port: int, case: Callable[[TensorParallelGroup], Any],
               env: dict[str, str], host: str | None, finish: bool, results: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(env)
    if host is not None:
        shm_collectives.host_identity = lambda: (host, "boot", 0)
    try:
        tp = TensorParallelGroup.initialize(world, rank, f"tcp://127.0.0.1:{port}", "cpu")
        out = case(tp)
        results.put((rank, out))
        if finish:
            tp.barrier()
            tp.destroy()
    except BaseException:  # noqa: BLE001 - the parent shows it
        results.put((rank, traceback.format_exc()))


def run_ranks(world: int, case: Callable[[TensorParallelGroup], Any],
              env: dict[str, str] | None = None, hosts: list[str | None] | None = None,
              expect: int | None = None, timeout: float = 240.0,
              finish: bool = True) -> dict[int, Any]:
    """`case(tp)` on every rank of a real CPU `TensorParallelGroup` of `world` spawned
    processes (`case` a module-level function; `hosts`: a host name per rank, for the
    shared-memory path's same-host check); rank -> what it returned, from the first `expect`
    ranks to answer (all by default). `finish`: the ranks meet and tear the group down after."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = get_free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, case, env or {},
                                                  (hosts or [None] * world)[r], finish, results))
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(out) < (world if expect is None else expect):
            rank, value = results.get(timeout=max(1.0, deadline - time.monotonic()))
            assert not isinstance(value, str), f"rank {rank} failed:\n{value}"
            out[rank] = value
    except queue.Empty:
        pytest.fail(f"{case.__name__}: only ranks {sorted(out)} answered within {timeout} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return out
