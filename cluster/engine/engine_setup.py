"""What an `LLMEngine` builds once at start, and the policies around it: the workers' config
from the engine's (`build_worker_config`), the executor that runs them (`build_executor`:
in-process or a Ray group), the sampling defaults a model recommends (`default_sampling`),
the garbage collector's start-up freeze, and how often a dead group is rebuilt
(`rebuild_or_raise`).

Invariant: everything an engine key changes about the workers passes through
`build_worker_config`, so the in-process and Ray executors start the same workers.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from cluster.engine.config import EngineConfig
from cluster.engine.executor import Executor, InProcessExecutor, WorkerDiedError
from cluster.engine.pooling import PoolingInfo
from cluster.engine.ray_executor import RayExecutor
from cluster.engine.rdt_transport import RDT_BACKENDS, resolve_kv_transport
from cluster.engine.stage_placement import StagesUnplacedError
from scheduler import SamplingParams
from scheduler.speculative import SpeculativeConfig
from workers.checkpoint import checkpoint_files
from workers.config import WorkerConfig
from workers.distributed import get_free_port
from workers.model_config import ModelConfig, load_generation_defaults
from workers.pipeline import layer_partition

logger = logging.getLogger(__name__)

# Below this many tokens per step, chunked prefill would starve long prompts of progress.
MIN_BATCHED_TOKENS = 8192

# How many times the engine tries to rebuild its workers after a rank died before it gives
# up (then it is dead, and Serve replaces the replica), and the wait before the second try,
# doubled before each later one (1 + 2 + 4 s). The waits are for a node that is dying: until
# Ray's GCS declares it dead (health_check_failure_threshold x period: 15 s by Ray's defaults)
# its bundles still look placed there, and a rank put there is cancelled when it is declared.
# A rebuild whose stages found no node with room (StagesUnplacedError, after
# stage_placement.REBUILD_PLACEMENT_WAIT_S) is not tried again: it already waited for room.
# The attempts count across failures until a step completes (Executor.rebuilds_without_step):
# a step that kills every group it runs on (one past dag_calls.STEP_BOUND_S, a rank that
# crashes on it) ends the engine after MAX_REBUILD_ATTEMPTS rebuilds, not in a loop of them.
MAX_REBUILD_ATTEMPTS = 4
REBUILD_BACKOFF_S = 1.0


def rebuild_or_raise(executor: Executor, error: WorkerDiedError) -> None:
    """Rebuild the executor's workers; once that failed MAX_REBUILD_ATTEMPTS times since the
    workers last completed a step (a rebuild whose group then died before finishing one counts
    as failed), or found no room for a lost stage, shut the executor down and raise
    WorkerDiedError (the engine dies; the ingress resumes its requests on another replica)."""
    if executor.rebuilds_without_step >= MAX_REBUILD_ATTEMPTS:
        executor.shutdown()
        raise WorkerDiedError(f"{error}; the workers were rebuilt "
                              f"{executor.rebuilds_without_step} time(s) and each new group "
                              "failed before finishing a step") from error
    last: BaseException = error
    for attempt in range(executor.rebuilds_without_step, MAX_REBUILD_ATTEMPTS):
        if attempt:
            logger.warning("engine: rebuilding the workers failed (%s: %s); retrying in %.0f s",
                           type(last).__name__, last, REBUILD_BACKOFF_S * 2 ** (attempt - 1))
            time.sleep(REBUILD_BACKOFF_S * 2 ** (attempt - 1))
        executor.rebuilds_without_step = attempt + 1
        try:
            executor.rebuild()
            return
        except StagesUnplacedError as e:
            last = e
            break
        except Exception as e:  # noqa: BLE001 — any failure counts as one attempt
            last = e
    # Dead: release the ranks' placement groups now, not when Serve stops the replica. A lost
    # stage's group stays pending (RESCHEDULING) and would take the room a node frees or
    # joins with, before Serve's replacement replica can be placed there.
    executor.shutdown()
    raise WorkerDiedError(f"{error}; rebuilding the workers failed after "
                          f"{executor.rebuilds_without_step} attempt(s): "
                          f"{type(last).__name__}: {last}") from last


# Allocations of container objects between two young-generation collections (CPython's
# default is 700). A decode step of 256 sequences allocates ~1000 (an output delta, its
# completion and their two lists per sequence), so at 700 the collector runs inside every
# step while that step's outputs are alive, walks them and promotes them to older
# generations, to be walked again. At 50,000 it runs every ~50 steps, when nearly all of those
# objects have been freed by reference counting already (bench/scheduler_bench.py,
# docs/benchmarks.md). Cyclic garbage waits a little longer; nothing else changes.
GC_GEN0_THRESHOLD = 50_000


def freeze_startup_heap() -> None:
    """Move every object alive now (model, tokenizer, one KVCacheBlock per KV block: 10^5 of
    them on a large GPU) out of the garbage collector's reach, as vLLM does after start-up.
    The cyclic collector otherwise walks them all on each full collection, which the
    per-token objects of every step trigger regularly: milliseconds taken out of a step.
    Also raises the young generation's threshold to GC_GEN0_THRESHOLD (see there)."""
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    if 0 < gen0 < GC_GEN0_THRESHOLD:
        gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def build_worker_config(config: EngineConfig, model_path: str, device: str, max_model_len: int,
                        batched: int, spec: SpeculativeConfig | None, draft_path: str | None,
                        pooling: PoolingInfo | None) -> WorkerConfig:
    """The workers' config for this engine config (every rank gets it, with its own rank)."""
    # (at pp > 1 each stage captures its own part of the step: workers/cuda_graph.py)
    eager = config.enforce_eager or pooling is not None
    return WorkerConfig(
        model=model_path, dtype=config.dtype, device=device,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        pp_layer_partition=config.pp_layer_partition,
        dist_init_method=(f"tcp://127.0.0.1:{get_free_port()}"
                          if config.world_size > 1 else None),
        block_size=config.block_size,
        max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=batched,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_gpu_blocks_override=config.num_gpu_blocks_override, swap_space=config.swap_space,
        kv_offloading_size=config.kv_offloading_size,
        enforce_eager=eager,
        attention_backend=config.attention_backend, seed=config.seed, cpu_nice=config.cpu_nice,
        # (async_scheduling null is auto, which is off on CPU, the only device this touches)
        cpu_exclusive=config.cpu_exclusive and not config.async_scheduling,
        enable_expert_parallel=config.enable_expert_parallel, speculative_model=draft_path,
        num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
        speculative_max_num_seqs=0 if spec is None else spec.disable_by_batch_size,
        hf_overrides=config.hf_overrides, kv_cache_dtype=config.kv_cache_dtype,
        quantization=config.quantization, load_format=config.load_format,
        calculate_kv_scales=config.calculate_kv_scales,
        max_loras=config.max_loras if config.enable_lora else 0,
        max_lora_rank=config.max_lora_rank if config.enable_lora else 0,
        pooler=None if pooling is None else pooling.pooler)


def weights_bytes(config: EngineConfig, model_path: str, model_config: ModelConfig) -> int:
    """The weights' bytes that EngineConfig.check_host_memory counts: the checkpoint's files
    (ValueError naming load_format 'dummy' when there are none); with load_format "dummy",
    what a checkpoint of config.json's shapes and dtype would hold."""
    if config.load_format == "dummy":
        return model_config.weight_bytes_per_rank(1, 4 if model_config.dtype == "float32" else 2)
    return sum(f.stat().st_size for f in checkpoint_files(model_path))


def check_layer_partition(config: EngineConfig, num_layers: int) -> None:
    """ValueError at start for a pp_layer_partition (or VLLM_PP_LAYER_PARTITION) that does not
    split the model's layers over the stages (workers/pipeline.py)."""
    if config.pipeline_parallel_size > 1:
        layer_partition(num_layers, config.pipeline_parallel_size, config.pp_layer_partition)


def build_executor(config: EngineConfig, worker_config: WorkerConfig, device: str,
                   placement_group: Any, lagged: bool) -> Executor:
    """The executor of `worker_config`'s ranks: a Ray group (`config.uses_ray`, in
    `placement_group` when the replica has one) or this process; a PD role's KV moves over
    Ray Direct Transport when `resolve_kv_transport` says so (ValueError if it cannot)."""
    rdt = config.kv_role is not None and resolve_kv_transport(config, device) == "rdt"
    if config.uses_ray:
        return RayExecutor(
            worker_config, num_cpus=config.worker_num_cpus, use_gpu=device == "cuda",
            placement_group=placement_group, bundle_offset=1 if placement_group else 0,
            compiled_graph=config.compiled_graph, lagged=lagged,
            rdt_backend=RDT_BACKENDS[device] if rdt else None,
            kv_ttl_s=config.kv_transfer_timeout_s)
    return InProcessExecutor(worker_config)


def default_sampling(model_path: str, generation_config: str) -> dict[str, Any]:
    """The SamplingParams fields a request that leaves them out gets (EngineConfig's
    `generation_config`): the model's recommended ones under "auto", checked here so a bad
    generation_config.json fails at start, not on the first request."""
    if generation_config == "vllm":
        return {}
    defaults = load_generation_defaults(model_path)
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{model_path}/generation_config.json recommends sampling settings "
                         f"SamplingParams refuses ({e}); fix the file or set generation_config: "
                         "vllm to ignore them") from None
    if defaults:
        logger.info("sampling defaults from %s/generation_config.json: %s (generation_config: "
                    "vllm ignores them)", model_path, defaults)
    return defaults
