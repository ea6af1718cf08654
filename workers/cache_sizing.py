"""How many KV blocks a worker rank holds: the bytes of one block, the CPU budget, and the
profiling run that measures a CUDA device's peak activation memory before the cache is sized.

A mixin of `workers.worker.Worker` (it reads the worker's config, model, LoRA slots and
draft runner, and runs one dummy step through `execute`): the sizing is one idea, the worker's
step loop another. Invariant: the engine takes the minimum of every rank's answer, and a rank
that cannot hold one `max_model_len` sequence says so with the knobs that would change it.
"""

from __future__ import annotations

import gc
import math
from typing import TypeVar

import numpy as np
import torch

from scheduler.plan import NewSeq, StepPlan
from scheduler.sampling_params import SamplingParams
from workers.cache_engine import CacheEngine

# KV cache budget on CPU without num_gpu_blocks_override: the host is shared by every rank,
# the tests and Ray, so each rank takes at most this much.
CPU_KV_CACHE_BYTES = 1 << 30
_GIB = 1 << 30
_T = TypeVar("_T")


class KVCacheSizing:
    """The worker's KV-cache sizing (see the module docstring)."""

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block on this rank: the target's layers (its pipeline stage's) and
        the draft's."""
        mc, itemsize = loaded(self.model_config), dtype_bytes(self.kv_dtype)
        draft = (0 if self.drafter is None
                 else self.drafter.kv_block_bytes(self.tp.world_size, itemsize))
        return mc.kv_block_bytes(self.config.block_size, self.tp.world_size, itemsize,
                                 len(loaded(self.model).attention_layers())) + draft

    def determine_num_blocks(self) -> tuple[int, int, int]:
        """(num_gpu_blocks, num_cpu_blocks, num_offload_blocks) this rank can hold.

        GPU blocks: `num_gpu_blocks_override` when set; on CUDA otherwise a profiling run at
        the largest batch measures peak activation memory and `gpu_memory_utilization` of the
        device minus what is in use and that peak becomes KV blocks; on CPU enough blocks
        for max_num_seqs full-length sequences, capped at `CPU_KV_CACHE_BYTES` (1 GiB) less
        the LoRA slots (on CUDA the profiling run finds them in use).
        CPU swap blocks: `swap_space` GiB. Offload-tier blocks: this rank's share of
        `kv_offloading_size` GiB (split evenly over the ranks).
        """
        cfg = self.config
        block_bytes = self.kv_block_bytes()
        num_cpu = int(cfg.swap_space * _GIB) // block_bytes
        num_offload = int(cfg.kv_offloading_size * _GIB / cfg.world_size) // block_bytes
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override, num_cpu, num_offload
        if self.device.type == "cpu":
            wanted = cfg.max_num_seqs * math.ceil(cfg.max_model_len / cfg.block_size)
            lora_bytes = 0 if self.lora is None else self.lora.nbytes
            num = min(wanted, (CPU_KV_CACHE_BYTES - lora_bytes) // block_bytes)
            needed = math.ceil(cfg.max_model_len / cfg.block_size)
            if lora_bytes and num < needed:
                raise ValueError(
                    f"the LoRA slots (max_loras={cfg.max_loras}, max_lora_rank="
                    f"{cfg.max_lora_rank}) take {lora_bytes / _GIB:.2f} GiB of the "
                    f"{CPU_KV_CACHE_BYTES / _GIB:.0f} GiB CPU KV budget, leaving {max(num, 0)} KV "
                    f"blocks (one max_model_len={cfg.max_model_len} sequence needs {needed}); "
                    "lower max_loras or max_lora_rank, or set num_gpu_blocks_override")
            return max(1, num), num_cpu, num_offload
        return self._profile_num_gpu_blocks(block_bytes), num_cpu, num_offload

    def _profile_num_gpu_blocks(self, block_bytes: int) -> int:
        cfg = self.config
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        peak_extra = self._profile_run()
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        # This engine's weights and workspaces; another process freeing memory meanwhile must
        # not make it look negative (and the share larger than gpu_memory_utilization).
        own = max(0, self._free_before_load - free)
        # Its share of the device, and never more than is free beside the activations' peak.
        available = min(int(total * cfg.gpu_memory_utilization) - own, free) - peak_extra
        num_blocks = available // block_bytes
        needed = math.ceil(cfg.max_model_len / cfg.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"only {max(num_blocks, 0)} KV blocks fit on rank {self.rank} (one "
                f"max_model_len={cfg.max_model_len} sequence needs {needed}); raise "
                "gpu_memory_utilization, lower max_num_batched_tokens/max_num_seqs/max_model_len, "
                f"or use more tensor-parallel ranks ({free / _GIB:.1f} GiB of "
                f"{total / _GIB:.1f} GiB free after loading; this engine took "
                f"{own / _GIB:.1f} GiB)")
        return int(num_blocks)

    def _profile_run(self) -> int:
        """Peak bytes allocated above the baseline by a forward + sampling at the largest batch."""
        cfg, mc = self.config, loaded(self.model_config)
        num_tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * cfg.max_model_len)
        num_seqs = min(cfg.max_num_seqs, num_tokens)
        lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int32)
        lens[: num_tokens % num_seqs] += 1
        blocks_per_seq = -(-lens // cfg.block_size)
        # A scratch cache just big enough for the dummy batch; freed before the real one.
        scratch = CacheEngine(self._num_cache_layers(), mc.num_kv_heads_per_rank(self.tp.world_size),
                              mc.head_dim, cfg.block_size, int(blocks_per_seq.sum()), 0,
                              self.kv_dtype, self.device)
        self._bind_cache(scratch)
        baseline = torch.cuda.memory_allocated()
        # (prompt logprobs too: their slices of logits are part of the peak)
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=5,
                                prompt_logprobs=5)
        starts = np.concatenate([[0], np.cumsum(blocks_per_seq)[:-1]])
        plan = StepPlan(
            step_id=-1, seq_ids=np.arange(num_seqs, dtype=np.int64), query_lens=lens,
            start_pos=np.zeros(num_seqs, dtype=np.int32),
            input_ids=np.zeros(num_tokens, dtype=np.int64), do_sample=np.ones(num_seqs, bool),
            new_seqs=[NewSeq(i, "profile", 0, int(lens[i]), [],
                             list(range(int(starts[i]), int(starts[i] + blocks_per_seq[i]))),
                             params, [0] * int(lens[i])) for i in range(num_seqs)])
        self.execute(plan)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        loaded(self.model_runner).table.drop(list(range(num_seqs)))
        loaded(self.model_runner).pending.reset()
        self._bind_cache(None)
        del scratch
        return max(0, peak - baseline)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def loaded(value: _T | None) -> _T:
    """`value`, one of the attributes `load_model()` sets; a clear error where it is still None."""
    if value is None:
        raise RuntimeError("the worker has no model loaded; call load_model() first")
    return value
