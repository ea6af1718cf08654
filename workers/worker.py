"""One rank: process group, model shard, KV cache, runner and sampler.

The engine drives every rank through the same calls in the same order:
`init_distributed` -> `load_model` -> `determine_num_blocks` (the engine takes the minimum
over ranks) -> `init_cache` -> `execute(plan)` per step -> `shutdown`.
Every rank runs the whole forward of its pipeline stage (the collectives need all of them;
workers/pipeline.py: a stage of a pp > 1 replica holds only its layers and KV and passes its
hidden states on); only the output rank (rank 0; the last stage's first at pp > 1) holds the
gathered logits, samples, and returns a StepResult. With a speculative draft model
(`speculative_model`, workers/draft_runner.py) every rank also holds its shard of the draft,
whose KV layers follow the target's in the same cache.
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kernels
from scheduler.plan import StepPlan, StepResult
from workers.cache_engine import CacheEngine
from workers.cache_sizing import KVCacheSizing, dtype_bytes, loaded
from workers.config import WorkerConfig
from workers.cpu_threads import (
    ThreadScope,
    head_threads,
    idle_head_threads,
    set_model_threads,
    set_process_nice,
    takes_every_core,
)
from workers.cuda_graph import capture_step_graphs
from workers.distributed import TensorParallelGroup
from workers.draft_runner import DraftRunner
from workers.kv_scales import arm_kv_scale_calculation
from workers.kv_transfer import pack_blocks, unpack_blocks
from workers.loader import load_model
from workers.lora import LoRAModel, check_lora_plan
from workers.model_config import ModelConfig, check_weights_fit, load_model_config
from workers.model_runner import ModelRunner, StepBatch
from workers.pipeline import OutputBroadcast, PipelineStage, get_pp_indices
from workers.pooler import Pooler
from workers.qwen3 import Qwen3ForCausalLM, ops_backend
from workers.rejection_sampler import num_accepted
from workers.sampler import SamplerOutput
from workers.step_outputs import StepOutputs
from workers.warmup import warmup_plans

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_EMPTY = np.zeros(0, dtype=np.int64)
# Steps launched ahead of their collection: the one running and the one after it.
MAX_LAUNCHED = 2


@dataclass(slots=True)
class _Launched:
    """A step between launch and collect."""

    step_id: int
    slot: int  # its StepOutputs slot
    keep_logits: bool
    batch: StepBatch | None = None  # None: an empty plan
    logits: torch.Tensor | None = None
    awaiting_bitmask: bool = False
    has_output: bool = False


class Worker(KVCacheSizing):
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.rank = config.rank
        self.tp = TensorParallelGroup.single()
        self.stage = PipelineStage.single()  # this rank's pipeline stage (workers/pipeline.py)
        # whose sampled ids async scheduling's pending tokens are (the output rank's)
        self.sampled_from: TensorParallelGroup | OutputBroadcast = self.tp
        self.is_output_rank = config.rank == config.output_rank  # samples, returns results
        self.model_config: ModelConfig | None = None
        self.model: Qwen3ForCausalLM | None = None
        self.model_runner: ModelRunner | None = None
        self.drafter: DraftRunner | None = None  # speculative decoding's draft model
        self.lora: LoRAModel | None = None  # LoRA wrappers and slots (WorkerConfig.max_loras)
        self.cache_engine: CacheEngine | None = None
        self._bound_cache: CacheEngine | None = None  # what the attention layers point at
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.kv_dtype = torch.float32  # the KV cache's: dtype, or float8_e4m3fn (kv_cache_dtype)
        # Steps launched and not yet collected, oldest first.
        self._launched: deque[_Launched] = deque()
        self._outputs: StepOutputs | None = None  # made by load_model
        self._free_before_load = 0  # device bytes free before this engine loaded (CUDA)

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
        set_process_nice(cfg.cpu_nice)
        tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
        self.tp = TensorParallelGroup.initialize(tp, cfg.rank, cfg.dist_init_method, cfg.device,
                                                 pp)
        self.stage = PipelineStage(cfg.rank // tp, pp, global_rank=cfg.rank, tp_size=tp)
        self.sampled_from = self.tp if pp == 1 else OutputBroadcast(cfg.rank, cfg.output_rank)

    def load_model(self) -> None:
        """Read config.json, build this rank's Qwen3 shard and fill it from the safetensors
        (`load_format` "dummy": with random values, workers/loader.py)."""
        cfg = self.config
        if cfg.device == "cuda" and self.device.type != "cuda":
            raise RuntimeError("call init_distributed() before load_model()")
        mc = load_model_config(cfg.model, cfg.tensor_parallel_size, cfg.hf_overrides,
                               cfg.quantization, cfg.load_format)
        mc.check_max_model_len(cfg.max_model_len)
        if cfg.device == "cpu":  # the cores the engine's Python does not need (cpu_threads.py)
            set_model_threads(cfg.tensor_parallel_size,
                              takes_every_core(cfg.cpu_exclusive, mc.hidden_size))
        if cfg.dtype == "auto":
            self.dtype = torch.float32 if cfg.device == "cpu" else _DTYPES[mc.dtype]
        else:
            self.dtype = _DTYPES[cfg.dtype]
        self.kv_dtype = self.dtype if cfg.kv_cache_dtype == "auto" else kernels.FP8_KV_DTYPE
        if self.device.type == "cuda":
            # What this engine will take is measured against the memory free before it loads:
            # `gpu_memory_utilization` is this engine's share of the device (vLLM's meaning),
            # whatever other engines in this process or other processes hold.
            torch.cuda.empty_cache()
            self._free_before_load = torch.cuda.mem_get_info()[0]
        stage = self.stage
        stage.start_layer, stage.end_layer = get_pp_indices(
            mc.num_hidden_layers, stage.rank, stage.size, cfg.pp_layer_partition)
        if self.device.type == "cuda":
            draft = (None if cfg.speculative_model is None
                     else load_model_config(cfg.speculative_model, cfg.tensor_parallel_size))
            check_weights_fit(mc, self.tp.world_size, dtype_bytes(self.dtype),
                              torch.cuda.mem_get_info()[1], cfg.gpu_memory_utilization, draft,
                              stage)
        with torch.device(self.device):
            model = Qwen3ForCausalLM(mc, self.tp, self.dtype, cfg.attention_backend,
                                     max_position=cfg.max_model_len,
                                     expert_parallel=cfg.enable_expert_parallel, stage=stage)
        load_model(model, cfg.model, cfg.load_format)
        model.eval()
        self.model_config = mc
        self.model = model
        if cfg.speculative_model is not None:
            self.drafter = DraftRunner.load(
                cfg.speculative_model, mc, self.tp, self.dtype, cfg.attention_backend,
                cfg.max_model_len, cfg.block_size, self.device)
        rows = cfg.max_num_seqs * (1 + cfg.num_speculative_tokens)  # (verify: k + 1 each)
        if cfg.max_loras:  # (before the KV cache is sized: its slots count as used memory)
            self.lora = LoRAModel(model, cfg.max_loras, cfg.max_lora_rank,
                                  max(cfg.max_num_batched_tokens, rows),
                                  ops_backend(cfg.attention_backend))
        pooler = None if cfg.pooler is None or not stage.is_last else Pooler(
            cfg.pooler, cfg.max_num_seqs, mc.hidden_size, self.device, self.tp.is_first)
        self.model_runner = ModelRunner(model, self.device, cfg.block_size, cfg.max_model_len,
                                        cfg.max_num_seqs, mc.vocab_size, cfg.seed, self.lora,
                                        pooler, stage, self._head_scope(mc.hidden_size))
        self._outputs = StepOutputs(self.device, rows, MAX_LAUNCHED + 1)

    def _head_scope(self, hidden_size: int) -> ThreadScope:
        """The LM head's and sampler's torch threads on CPU (workers/cpu_threads.py): every
        core for an exclusive engine's narrow model, the idle ones for a served engine's; the
        model's count for a background role (`cpu_nice`: it yields cores, it takes none),
        otherwise and on a GPU."""
        cfg = self.config
        if cfg.device != "cpu":
            return ThreadScope(None)
        if cfg.cpu_exclusive:
            return ThreadScope(head_threads(True, hidden_size, cfg.tensor_parallel_size))
        if cfg.cpu_nice:  # e.g. a PD app's prefill role: the idle core is the decode role's
            return ThreadScope(None)
        return ThreadScope(idle_head_threads(False, hidden_size, cfg.tensor_parallel_size),
                           when_idle=True)

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int,
                   num_offload_blocks: int = 0) -> None:
        """Allocate the KV cache, swap space and offload tier, then capture decode CUDA graphs
        (CUDA, not eager)."""
        cfg, mc = self.config, loaded(self.model_config)
        self.cache_engine = CacheEngine(
            self._num_cache_layers(), mc.num_kv_heads_per_rank(self.tp.world_size), mc.head_dim,
            cfg.block_size, num_gpu_blocks, num_cpu_blocks, self.kv_dtype, self.device,
            num_offload_blocks)
        self._bind_cache(self.cache_engine)
        # The torch reference attention reads lengths on the host, so it cannot be captured.
        if self.device.type == "cuda" and not cfg.enforce_eager \
                and cfg.attention_backend != "torch":
            self.capture_graphs()
        if self.device.type == "cuda":
            self.warm_up()
        if cfg.calculate_kv_scales:  # (after the warm-up's dummy steps)
            arm_kv_scale_calculation(self._attention_layers())

    def capture_graphs(self, graph_factory: Callable[[], Any] | None = None) -> None:
        """Capture the decode and verify graphs, with the draft's, of this rank's pipeline
        stage (workers/cuda_graph.py); `graph_factory` EagerGraph runs the graph path on CPU."""
        cfg, runner = self.config, loaded(self.model_runner)
        if self.lora is not None:  # the graphs always hold the LoRA products
            self.lora.batch.active = True
        runner.graph_runner, runner.verify_graph_runners = capture_step_graphs(
            loaded(self.model), self.drafter, self.tp, cfg.max_num_seqs,
            runner.table.max_blocks_per_seq, cfg.max_model_len, self.device,
            cfg.num_speculative_tokens, cfg.speculative_max_num_seqs, graph_factory, self.stage)

    def warm_up(self) -> None:
        """Run the start-up warm-up's plans (workers/warmup.py) on the real cache; the worker
        holds no sequence afterwards."""
        cfg, mc = self.config, loaded(self.model_config)
        runner = loaded(self.model_runner)
        decode_shapes = kernels.ops.paged_attention_decode_shapes(
            cfg.max_num_seqs, mc.num_kv_heads_per_rank(self.tp.world_size), cfg.max_model_len,
            self.device, cfg.attention_backend)
        for plan in warmup_plans(cfg.block_size, runner.num_gpu_blocks, cfg.max_model_len,
                                 cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                 eager_decode=runner.graph_runner is None,
                                 decode_shapes=decode_shapes):
            self.execute(plan)
        runner.pending.reset()
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _bind_cache(self, cache: CacheEngine | None) -> None:
        """Point the attention layers at `cache` (None: at nothing)."""
        self._bound_cache = cache
        if cache is None:
            for attn in self._attention_layers():
                attn.k_cache = attn.v_cache = torch.tensor([])
            return
        cache.bind(self._attention_layers())
        loaded(self.model_runner).num_gpu_blocks = cache.num_gpu_blocks

    def _attention_layers(self) -> list:
        """The target's attention layers, then the draft's: the cache's layers, in order."""
        layers = loaded(self.model).attention_layers()
        return layers if self.drafter is None else layers + self.drafter.attention_layers()

    def _num_cache_layers(self) -> int:
        return len(self._attention_layers())

    # ---- steps ----------------------------------------------------------------------------
    #
    # A step is launched, then collected. `launch(plan)` applies the plan's diffs, stages its
    # inputs (one H2D copy), fills its pending tokens on the device from the last step's
    # sampled ids, and enqueues the forward, the logits, the sampling and a non-blocking copy
    # of the sampled ids into pinned memory: on CUDA it returns before the GPU has run any of
    # it. `collect(step_id)` waits for that step's copy (the one host wait of a step) and
    # returns rank 0's StepResult. A plan with constrained rows samples once
    # `provide_bitmask` hands their grammar bitmask over. Steps are launched and collected in
    # plan order, at most MAX_LAUNCHED launched and not collected.

    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run one StepPlan (see scheduler.plan for the order); rank 0 returns the sampled tokens."""
        self.launch(plan)
        return self.collect(plan.step_id)[0]

    def execute_with_logits(self, plan: StepPlan) -> tuple[StepResult | None, torch.Tensor | None]:
        """`execute`, also returning rank 0's raw logits `[S, vocab]` of the sampled rows
        (what parity tests compare with Hugging Face)."""
        self.launch(plan, keep_logits=True)
        return self.collect(plan.step_id)

    def execute_lagged(self, plan: StepPlan | None) -> StepResult | None:
        """Launch `plan` (None: nothing new), then collect the step launched before it: the
        device runs this plan while the caller handles the last one's tokens (how a Ray worker
        overlaps steps: its result for plan N comes back from the call that brings plan N+1)."""
        previous = self._launched[0].step_id if self._launched else None
        if plan is not None:
            self.launch(plan)
        return None if previous is None else self.collect(previous)[0]

    def launch(self, plan: StepPlan, keep_logits: bool = False) -> None:
        """Start a plan (see the section comment); errors in the plan raise ValueError."""
        cache = self._bound_cache
        if cache is None:
            raise RuntimeError("call init_cache() before execute()")
        if self._launched and self._launched[-1].awaiting_bitmask:
            raise RuntimeError(f"plan {plan.step_id} launched before plan "
                               f"{self._launched[-1].step_id} got its grammar bitmask")
        if len(self._launched) >= MAX_LAUNCHED:
            raise RuntimeError(f"{len(self._launched)} steps launched and not collected; "
                               "collect the oldest first")
        runner = loaded(self.model_runner)
        step = _Launched(plan.step_id, self._outputs.begin(), keep_logits)
        runner.table.drop(plan.dropped_seq_ids)
        # On the copy stream, after all compute so far (so offloads read the evicted blocks
        # before anything of this step overwrites them); copy-on-write waits for them.
        cache.transfer(plan.offload, plan.swap_out, plan.swap_in, plan.load)
        cache.copy(plan.copies)
        check_lora_plan(plan, self.config.max_loras)
        if plan.lora_loads:
            self.lora.load(plan.lora_loads)
        if plan.is_empty:
            cache.wait_transfers()
            runner.table.apply(plan)
            runner.pending.record(plan.step_id, _EMPTY)
            self._launched.append(step)
            return
        batch = runner.prepare(plan)
        drafter = self.drafter
        if (batch.draft is not None or batch.draft_in_graph) and drafter is None:
            raise ValueError(f"plan {plan.step_id} has DRAFT_TOKEN proposals, but this worker "
                             "has no draft model (WorkerConfig.speculative_model)")
        step.batch = batch
        self._launched.append(step)
        runner.fill_pending(batch, self.sampled_from)
        # The forwards (the draft's, then the target's) read loaded blocks, write offloaded ones.
        cache.wait_transfers()
        # the draft's proposals into the verify rows, on device (a graph step: in its replay)
        if batch.draft is not None:
            table = runner.table
            assert drafter is not None and batch.verify is not None
            drafter.propose(batch.input_ids, batch.verify[1], batch.draft, table.block_table,
                            None if table.device_is_host else table.device_block_table, self.tp)
        logits, tokens = runner.forward(batch, keep_logits)
        step.logits = logits
        if batch.prompt_out is not None:  # (rank 0's prompt logprobs)
            assert batch.prompt is not None
            self._outputs.put_prompt(step.slot, batch.prompt, batch.prompt_out)
            step.has_output = True
        if batch.pooled is not None:  # (rank 0's pooling output: no sampling)
            self._outputs.put_pooled(step.slot, batch.pooled)
            step.has_output = True
        if tokens is not None:  # sampled in a CUDA graph or over the vocabulary shards
            self._sampled(step, SamplerOutput(tokens, None, None, None))
        elif logits is not None:  # (None: ranks > 0, or nothing samples)
            if plan.num_constrained:
                step.awaiting_bitmask = True
            else:
                self._sampled(step, runner.sample(batch, logits))
        if drafter is not None:  # (after sampling: the tokens' copy need not wait for it)
            runner.follow(batch, drafter)

    def provide_bitmask(self, step_id: int, bitmask: np.ndarray) -> None:
        """The grammar bitmask of a launched step's constrained rows (int32 [C, ceil(V/32)],
        in the order of the plan's `constrained_rows`); that step samples now. Ranks > 0
        sample nothing and ignore it."""
        step = next((s for s in self._launched if s.step_id == step_id), None)
        if step is None:
            raise ValueError(f"step {step_id} is not launched (or already collected)")
        if not step.awaiting_bitmask:
            if not self.is_output_rank:
                return
            raise ValueError(f"step {step_id} has no constrained rows waiting for a bitmask")
        step.awaiting_bitmask = False
        runner = loaded(self.model_runner)
        assert step.batch is not None and step.logits is not None
        mask = runner.bitmask_for(step.batch, bitmask)
        self._sampled(step, runner.sample(step.batch, step.logits, mask))

    def step_ready(self, step_id: int) -> bool:
        """Whether collect(step_id) would not wait (always, on CPU)."""
        step = self._launched[0] if self._launched else None
        if step is None or step.step_id != step_id or step.awaiting_bitmask:
            return False
        return not step.has_output or self._outputs.ready(step.slot)

    def awaiting_bitmask(self) -> int | None:
        """The launched step whose sampling waits for its grammar bitmask, if any."""
        last = self._launched[-1] if self._launched else None
        return last.step_id if last is not None and last.awaiting_bitmask else None

    def _sampled(self, step: _Launched, out: SamplerOutput) -> None:
        """The step's tokens: kept on the device for the next step's pending tokens, and
        copied to pinned memory for collect."""
        assert step.batch is not None
        loaded(self.model_runner).pending.sampled(out.token_ids)
        verify = step.batch.verify
        num_tokens = None if verify is None else num_accepted(out.token_ids, *verify) + 1
        self._outputs.put(step.slot, out, step.batch.num_sampled, num_tokens)
        step.has_output = True

    def collect(self, step_id: int) -> tuple[StepResult | None, torch.Tensor | None]:
        """Wait for a launched step; the output rank's StepResult (None on other ranks; rank 0
        unless pipeline-parallel: the last stage's first) and, when it
        was launched with keep_logits, its logits."""
        oldest = self._launched[0].step_id if self._launched else None
        if oldest != step_id:
            raise ValueError(f"collect({step_id}): the oldest launched step is {oldest}")
        if self._launched[0].awaiting_bitmask:
            raise ValueError(f"step {step_id} needs its grammar bitmask (provide_bitmask) "
                             "before it can be collected")
        step = self._launched.popleft()
        if not self.is_output_rank:
            return None, None
        seq_ids = _EMPTY if step.batch is None else step.batch.sampled_seq_ids
        if step.has_output:
            result = self._outputs.take(step.slot, step_id, seq_ids)
        else:
            result = StepResult(step_id, seq_ids, _EMPTY)
        return result, step.logits if step.keep_logits else None

    def export_kv(self, block_ids: list[int], to_host: bool = True) -> torch.Tensor:
        """This rank's KV of `block_ids` as one payload (workers/kv_transfer.py)."""
        return pack_blocks(self._cache_tensor(), block_ids, to_host)

    def import_kv(self, block_ids: list[int], payload: torch.Tensor, first: int = 0) -> None:
        """Write payload blocks `first ..` into `block_ids` (workers/kv_transfer.py)."""
        unpack_blocks(self._cache_tensor(), block_ids, payload.narrow(2, first, len(block_ids)))

    def _cache_tensor(self) -> torch.Tensor:
        if self._bound_cache is None:
            raise RuntimeError("call init_cache() before a KV transfer")
        return self._bound_cache.gpu_cache

    def shutdown(self) -> None:
        """Release the cache, the model and the process group. Also what a start-up that
        failed part-way built (the executors call it then): the attention layers let go of
        the cache first, so a model something else still holds (a failed start's traceback:
        its frames keep the model) no longer keeps the KV cache on the device."""
        if self.model is not None:
            self._bind_cache(None)
        self.cache_engine = self._bound_cache = None
        self.model_runner = self.drafter = self._outputs = self.lora = None
        self.model = None
        self._launched.clear()
        self.tp.destroy()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

