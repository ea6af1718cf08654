"""One tensor-parallel rank: process group, model shard, KV cache, runner and sampler.

The engine drives every rank through the same calls in the same order:
`init_distributed` -> `load_model` -> `determine_num_blocks` (the engine takes the minimum
over ranks) -> `init_cache` -> `execute(plan)` per step -> `shutdown`.
Every rank runs the whole forward (the collectives need all of them); only rank 0 holds the
gathered logits, samples, and returns a StepResult.
"""

from __future__ import annotations

import gc
import math
import time
from typing import TypeVar

import numpy as np
import torch

from scheduler.plan import PENDING_TOKEN, NewSeq, StepPlan, StepResult
from scheduler.sampling_params import SamplingParams
from workers.cache_engine import CacheEngine
from workers.config import WorkerConfig
from workers.cuda_graph import CUDAGraphRunner
from workers.distributed import TensorParallelGroup
from workers.loader import load_model
from workers.model_config import ModelConfig, load_model_config
from workers.model_runner import ModelRunner
from workers.qwen3 import Qwen3ForCausalLM
from workers.sampler import Sampler

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV cache budget on CPU without num_gpu_blocks_override: the host is shared by every rank,
# the tests and Ray, so each rank takes at most this much.
CPU_KV_CACHE_BYTES = 1 << 30
_GIB = 1 << 30
_T = TypeVar("_T")


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.rank = config.rank
        self.tp = TensorParallelGroup.single()
        self.model_config: ModelConfig | None = None
        self.model: Qwen3ForCausalLM | None = None
        self.model_runner: ModelRunner | None = None
        self.cache_engine: CacheEngine | None = None
        self.sampler: Sampler | None = None
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        # Rank 0's answer to the last plan: the next plan's pending tokens (async scheduling)
        self._last_result: StepResult | None = None

    # ---- set-up ---------------------------------------------------------------------------

    def init_distributed(self) -> None:
        """Bind the device and join the tensor-parallel group (nothing to join when tp == 1)."""
        cfg = self.config
        if cfg.device == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu'")
            # Under Ray each rank sees one GPU (index 0); in a bare multi-process run rank r uses GPU r.
            torch.cuda.set_device(cfg.rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.tp = TensorParallelGroup.initialize(cfg.tensor_parallel_size, cfg.rank,
                                                 cfg.dist_init_method, cfg.device)

    def load_model(self) -> None:
        """Read config.json, build this rank's Qwen3 shard and fill it from the safetensors."""
        cfg = self.config
        if cfg.device == "cuda" and self.device.type != "cuda":
            raise RuntimeError("call init_distributed() before load_model()")
        mc = load_model_config(cfg.model, cfg.tensor_parallel_size)
        if cfg.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's "
                             f"max_position_embeddings={mc.max_position_embeddings}; lower it")
        if cfg.dtype == "auto":
            self.dtype = torch.float32 if cfg.device == "cpu" else _DTYPES[mc.dtype]
        else:
            self.dtype = _DTYPES[cfg.dtype]
        with torch.device(self.device):
            model = Qwen3ForCausalLM(mc, self.tp, self.dtype, cfg.attention_backend,
                                     max_position=cfg.max_model_len)
        load_model(model, cfg.model)
        model.eval()
        self.model_config = mc
        self.model = model
        self.model_runner = ModelRunner(model, self.device, cfg.block_size, cfg.max_model_len,
                                        cfg.max_num_seqs)
        self.sampler = Sampler(self.device, cfg.seed)

    def kv_block_bytes(self) -> int:
        mc = _loaded(self.model_config)
        return mc.kv_block_bytes(self.config.block_size, self.tp.world_size,
                                 torch.empty(0, dtype=self.dtype).element_size())

    def determine_num_blocks(self) -> tuple[int, int]:
        """(num_gpu_blocks, num_cpu_blocks) this rank can hold.

        GPU blocks: `num_gpu_blocks_override` when set; on CUDA otherwise a profiling run at
        the largest batch measures peak activation memory and `gpu_memory_utilization` of the
        device minus what is in use and that peak becomes KV blocks; on CPU enough blocks
        for max_num_seqs full-length sequences, capped at `CPU_KV_CACHE_BYTES` (1 GiB).
        CPU swap blocks: `swap_space` GiB.
        """
        cfg = self.config
        block_bytes = self.kv_block_bytes()
        num_cpu = int(cfg.swap_space * _GIB) // block_bytes
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override, num_cpu
        if self.device.type == "cpu":
            wanted = cfg.max_num_seqs * math.ceil(cfg.max_model_len / cfg.block_size)
            return max(1, min(wanted, CPU_KV_CACHE_BYTES // block_bytes)), num_cpu
        return self._profile_num_gpu_blocks(block_bytes), num_cpu

    def _profile_num_gpu_blocks(self, block_bytes: int) -> int:
        cfg = self.config
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        peak_extra = self._profile_run()
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used = total - free  # weights, CUDA context, library workspaces, other processes
        available = int(total * cfg.gpu_memory_utilization) - used - peak_extra
        num_blocks = available // block_bytes
        needed = math.ceil(cfg.max_model_len / cfg.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"only {max(num_blocks, 0)} KV blocks fit on rank {self.rank} (one "
                f"max_model_len={cfg.max_model_len} sequence needs {needed}); raise "
                "gpu_memory_utilization, lower max_num_batched_tokens/max_num_seqs/max_model_len, "
                "or use more tensor-parallel ranks")
        return int(num_blocks)

    def _profile_run(self) -> int:
        """Peak bytes allocated above the baseline by a forward + sampling at the largest batch."""
        cfg, mc = self.config, _loaded(self.model_config)
        num_tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * cfg.max_model_len)
        num_seqs = min(cfg.max_num_seqs, num_tokens)
        lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int32)
        lens[: num_tokens % num_seqs] += 1
        blocks_per_seq = -(-lens // cfg.block_size)
        # A scratch cache just big enough for the dummy batch; freed before the real one.
        scratch = CacheEngine(mc.num_hidden_layers, mc.num_kv_heads_per_rank(self.tp.world_size),
                              mc.head_dim, cfg.block_size, int(blocks_per_seq.sum()), 0,
                              self.dtype, self.device)
        self._bind_cache(scratch)
        baseline = torch.cuda.memory_allocated()
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=5)
        starts = np.concatenate([[0], np.cumsum(blocks_per_seq)[:-1]])
        plan = StepPlan(
            step_id=-1, seq_ids=np.arange(num_seqs, dtype=np.int64), query_lens=lens,
            start_pos=np.zeros(num_seqs, dtype=np.int32),
            input_ids=np.zeros(num_tokens, dtype=np.int64), do_sample=np.ones(num_seqs, bool),
            new_seqs=[NewSeq(i, "profile", 0, int(lens[i]), [],
                             list(range(int(starts[i]), int(starts[i] + blocks_per_seq[i]))),
                             params) for i in range(num_seqs)])
        self._execute(plan)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        _loaded(self.model_runner).drop_states(list(range(num_seqs)))
        for attn in _loaded(self.model).attention_layers():
            attn.k_cache = attn.v_cache = torch.tensor([])
        del scratch
        return max(0, peak - baseline)

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the KV cache and swap space, then capture decode CUDA graphs (CUDA, not eager)."""
        cfg, mc = self.config, _loaded(self.model_config)
        self.cache_engine = CacheEngine(
            mc.num_hidden_layers, mc.num_kv_heads_per_rank(self.tp.world_size), mc.head_dim,
            cfg.block_size, num_gpu_blocks, num_cpu_blocks, self.dtype, self.device)
        self._bind_cache(self.cache_engine)
        runner = _loaded(self.model_runner)
        if self.device.type == "cuda" and not cfg.enforce_eager \
                and cfg.attention_backend != "torch":
            # The torch reference attention reads lengths on the host, so it cannot be captured.
            graphs = CUDAGraphRunner(_loaded(self.model), cfg.max_num_seqs,
                                     runner.max_blocks_per_seq, cfg.max_model_len,
                                     mc.hidden_size, self.dtype, self.device)
            graphs.capture()
            runner.graph_runner = graphs

    def _bind_cache(self, cache: CacheEngine) -> None:
        cache.bind(_loaded(self.model).attention_layers())
        _loaded(self.model_runner).num_gpu_blocks = cache.num_gpu_blocks

    # ---- steps ----------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run one StepPlan (see scheduler.plan for the order); rank 0 returns the sampled tokens."""
        return self.execute_with_logits(plan)[0]

    def execute_with_logits(self, plan: StepPlan) -> tuple[StepResult | None, torch.Tensor | None]:
        """`execute`, also returning rank 0's raw logits `[S, vocab]` of the sampled rows
        (what parity tests compare with Hugging Face)."""
        if self.cache_engine is None:
            raise RuntimeError("call init_cache() before execute()")
        start = time.perf_counter()
        result, logits = self._execute(plan)
        if result is not None:
            result.forward_seconds = time.perf_counter() - start
            self._last_result = result
        return result, logits

    def _execute(self, plan: StepPlan) -> tuple[StepResult | None, torch.Tensor | None]:
        runner = _loaded(self.model_runner)
        runner.drop_states(plan.dropped_seq_ids)
        if self.cache_engine is not None:
            self.cache_engine.swap_out(plan.swap_out)
            self.cache_engine.swap_in(plan.swap_in)
            self.cache_engine.copy(plan.copies)
        runner.add_states(plan)
        empty = np.zeros(0, dtype=np.int64)
        if plan.is_empty:
            return (StepResult(plan.step_id, empty, empty) if self.tp.is_first else None), None
        logits, inp = runner.execute_model(plan, self._resolve_pending(plan))
        if not self.tp.is_first:
            return None, None
        seq_ids = plan.seq_ids[plan.do_sample].astype(np.int64)
        if logits is None:
            return StepResult(plan.step_id, seq_ids, empty), None
        md = runner.sampling_metadata(inp, _loaded(self.model_config).vocab_size)
        out = _loaded(self.sampler)(logits, md)
        result = StepResult(plan.step_id, seq_ids, out.token_ids.cpu().numpy())
        if out.logprobs is not None:
            result.logprobs = out.logprobs.cpu().numpy()
            result.top_token_ids = out.top_token_ids.cpu().numpy()
            result.top_logprobs = out.top_logprobs.cpu().numpy()
        return result, logits

    def _resolve_pending(self, plan: StepPlan) -> np.ndarray:
        """plan.input_ids with every PENDING_TOKEN (async scheduling, see scheduler.plan)
        replaced by the token this worker's group sampled for that sequence in the plan it
        executed just before. Rank 0 sampled it; the other ranks get it by broadcast."""
        ids = plan.input_ids
        where = np.flatnonzero(ids == PENDING_TOKEN)
        if not where.size:
            return ids
        filled = ids.copy()
        if self.tp.is_first:
            last = self._last_result
            step_id = -1 if last is None else last.step_id
            if last is None or step_id != plan.step_id - 1:
                raise ValueError(f"plan {plan.step_id} has pending tokens, but the last plan "
                                 f"this worker sampled for was {step_id}")
            sampled = dict(zip(last.seq_ids.tolist(), last.token_ids.tolist()))
            ends = np.cumsum(plan.query_lens)
            owners = plan.seq_ids[np.searchsorted(ends, where, side="right")].tolist()
            missing = [s for s in owners if s not in sampled]
            if missing:
                raise ValueError(f"plan {plan.step_id} has pending tokens for seqs {missing}, "
                                 f"which plan {step_id} did not sample")
            filled[where] = [sampled[s] for s in owners]
        if self.tp.world_size > 1:  # the collective's tensors live on the group's device
            values = torch.from_numpy(filled[where]).to(self.device)
            filled[where] = self.tp.broadcast_from_first(values).cpu().numpy()
        return filled

    def shutdown(self) -> None:
        """Release the cache, the model and the process group."""
        self.cache_engine = None
        self.model_runner = None
        self.model = None
        self.tp.destroy()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _loaded(value: _T | None) -> _T:
    """`value`, one of the attributes `load_model()` sets; a clear error where it is still None."""
    if value is None:
        raise RuntimeError("the worker has no model loaded; call load_model() first")
    return value
