"""FP8 KV cache (kv_cache_dtype fp8 / fp8_e4m3, per-tensor scales of 1.0) in the worker (other
scales: test_kv_scales.py).

- The twins: a write stores x / scale saturated in e4m3; attention over an FP8 cache equals,
  bit for bit, attention over a float32 cache holding its dequantized values.
- The worker: logits within FP8_LOGIT_BOUND of the full-precision-KV run on the same tokens at
  tp 1 and tp 2, and the Triton kernels' (interpreter) close to the torch kernels'; swap,
  copy-on-write and the offload tier move the FP8 bytes unchanged; the same memory holds
  twice the blocks of a bf16 cache.
- Refusals at start naming the key and the choices.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from workers_testlib import SECOND_CONFIG, LocalExecutor, PlanBuilder, parity_prompts

import kernels
from cluster.engine.config import EngineConfig
from kernels import reference
from scheduler.sampling_params import SamplingParams
from workers.cache_engine import CacheEngine
from workers.config import WorkerConfig
from workers.worker import Worker

F8 = torch.float8_e4m3fn
# Teacher-forced logits of the FP8-KV run vs the fp32-KV run, over max |logit| of the step:
# e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4) on K and V at scale 1.0; observed
# 0.042-0.056 on this random-weight model (tp 1 and tp 2).
FP8_LOGIT_BOUND = 0.1
NEW_TOKENS = 24


def _scales(k: float, v: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([k]), torch.tensor([v])


def test_write_stores_value_over_scale_saturated() -> None:
    k_cache, v_cache = torch.zeros(2, 4, 1, 4, dtype=F8), torch.zeros(2, 4, 1, 4, dtype=F8)
    key = torch.tensor([[[1.0, -3.0, 1000.0, 0.3]], [[9.0, 9.0, 9.0, 9.0]]])
    value = -key
    kernels.write_kv(key, value, k_cache, v_cache, torch.tensor([5, -1]), backend="torch",
                     k_scale=torch.tensor([2.0]), v_scale=torch.tensor([0.5]))
    want_k = (key[0] / 2.0).clamp(-448, 448).to(F8)
    assert torch.equal(k_cache[1, 1].float(), want_k.float())
    assert k_cache[1, 1, 0, 2].float() == 448.0  # 500 saturates at e4m3's largest value
    assert torch.equal(v_cache[1, 1].float(), (value[0] / 0.5).clamp(-448, 448).to(F8).float())
    assert int((k_cache.float() != 0).sum()) == 4  # the -1 slot wrote nothing


def test_attention_over_fp8_equals_attention_over_its_dequantized_values() -> None:
    """Two decodes (the batched decode path) and a prefill chunk over a cached prefix."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, bs, hkv, hq, d = 12, 4, 2, 4, 8
    k_full = torch.randn(num_blocks, bs, hkv, d, generator=gen) * 3
    v_full = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    k_scale, v_scale = _scales(0.05, 0.01)
    k8 = reference.quantize_kv(k_full, F8, k_scale)
    v8 = reference.quantize_kv(v_full, F8, v_scale)
    k_deq, v_deq = k8.float() * k_scale, v8.float() * v_scale
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0], [9, 4, 11, 6]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 6, 15], dtype=torch.int32)
    q_start = torch.tensor([0, 1, 2, 7], dtype=torch.int32)  # q lens 1, 1, 5
    q = torch.randn(7, hq, d, generator=gen)
    args = (tables, q_start, seq_lens, d ** -0.5, 5, 15)
    got = kernels.paged_attention(q, k8, v8, *args, backend="torch", k_scale=k_scale,
                                  v_scale=v_scale)
    want = kernels.paged_attention(q, k_deq, v_deq, *args, backend="torch")
    assert torch.equal(got, want)
    assert not torch.allclose(got, kernels.paged_attention(q, k_full, v_full, *args,
                                                           backend="torch"), atol=1e-6)


@pytest.mark.parametrize(("backend", "scales", "message"), [
    ("flash_attn", True, r"the 'flash_attn' kernels do not read an FP8 KV cache"),
    ("torch", False, r"FP8 \(float8_e4m3fn\) KV cache needs k_scale and v_scale"),
])
def test_kernels_refuse_what_they_cannot_read(backend: str, scales: bool, message: str) -> None:
    cache = torch.zeros(2, 4, 1, 4, dtype=F8)
    extra = dict(zip(("k_scale", "v_scale"), _scales(1.0, 1.0))) if scales else {}
    with pytest.raises(ValueError, match=message):
        kernels.paged_attention(torch.zeros(1, 1, 4), cache, cache.clone(),
                                torch.zeros(1, 1, dtype=torch.int32),
                                torch.tensor([0, 1], dtype=torch.int32),
                                torch.tensor([1], dtype=torch.int32), 0.5, 1, 1,
                                backend=backend, **extra)


@pytest.mark.parametrize(("args", "message"), [
    ({"kv_cache_dtype": "fp16"},
     r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3'\]; got 'fp16'"),
    ({"kv_cache_dtype": "fp8", "attention_backend": "flash_attn"},
     r"kv_cache_dtype 'fp8' is not read by attention_backend 'flash_attn'; choose "
     r"attention_backend 'auto', 'triton' or 'torch'"),
    ({"calculate_kv_scales": True}, r"calculate_kv_scales needs an FP8 KV cache"),
])
def test_engine_args_are_refused_naming_the_choices(args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_dict(args)


def test_worker_config_refuses_fp8_with_flash_attn() -> None:
    with pytest.raises(ValueError, match="attention_backend 'flash_attn'"):
        WorkerConfig(model="m", device="cuda", kv_cache_dtype="fp8",
                     attention_backend="flash_attn")
    assert WorkerConfig(model="m", device="cuda", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


def test_same_memory_holds_twice_the_blocks_of_bf16(tiny_dir: str) -> None:
    counts = {}
    for kv in ("auto", "fp8"):
        worker = Worker(WorkerConfig(model=tiny_dir, dtype="bfloat16", kv_cache_dtype=kv,
                                     max_num_seqs=4096, max_model_len=4096, swap_space=0.25,
                                     kv_offloading_size=0.25))
        worker.init_distributed()
        worker.load_model()
        counts[kv] = (worker.kv_block_bytes(), *worker.determine_num_blocks())
    (bf16_bytes, *bf16), (fp8_bytes, *fp8) = counts["auto"], counts["fp8"]
    assert bf16_bytes == 2 * fp8_bytes
    assert [b / a for a, b in zip(bf16, fp8)] == [2.0, 2.0, 2.0]  # GPU, swap, offload blocks


def test_swap_offload_and_copy_on_write_move_fp8_bytes_unchanged() -> None:
    cache = CacheEngine(2, 2, 8, 4, num_gpu_blocks=6, num_cpu_blocks=3, dtype=F8,
                        device=torch.device("cpu"), num_offload_blocks=3)
    gen = torch.Generator().manual_seed(1)
    cache.gpu_cache.copy_((torch.randn(cache.gpu_cache.shape, generator=gen) * 50).to(F8))
    before = cache.gpu_cache.view(torch.uint8).clone()
    cache.transfer(offload=np.array([[0, 2]]), swap_out=np.array([[1, 0]]))
    cache.copy(np.array([[2, 3]]))
    cache.transfer(swap_in=np.array([[0, 4]]), load=np.array([[2, 5]]))
    after = cache.gpu_cache.view(torch.uint8)
    for src, dst in ((1, 4), (0, 5), (2, 3)):
        assert torch.equal(after[:, :, dst], before[:, :, src])


class _Forced(PlanBuilder):
    """Feeds each sequence the given tokens instead of its own samples (teacher forcing)."""

    def __init__(self, forced: dict[int, list[int]]) -> None:
        super().__init__(block_size=16, num_gpu_blocks=64, token_budget=24)
        self.forced = forced

    def apply(self, plan, result, logits) -> None:
        result.token_ids = np.array([self.forced[int(s)][len(self.seqs[int(s)].outputs)]
                                     for s in result.seq_ids], dtype=np.int64)
        super().apply(plan, result, logits)


def _forced_logits(executor, prompts, forced=None) -> tuple[dict, dict]:
    builder = _Forced(forced) if forced else PlanBuilder(block_size=16, num_gpu_blocks=64,
                                                         token_budget=24)
    ids = [builder.add(p, SamplingParams(temperature=0), max_tokens=NEW_TOKENS) for p in prompts]
    outputs = builder.run(executor)
    return ({i: outputs[i] for i in ids},
            {i: np.stack(builder.seqs[i].logits) for i in ids})


def _assert_within_bound(got: dict, want: dict) -> None:
    for sid, ref in want.items():
        err = np.abs(got[sid] - ref).max(axis=1) / np.abs(ref).max(axis=1)
        assert err.max() <= FP8_LOGIT_BOUND, (sid, err.max())
        assert err.max() > 0  # the cache really is FP8


@pytest.fixture(scope="module")
def full_precision(second_dir: str) -> tuple[list, dict, dict]:
    prompts = parity_prompts(SECOND_CONFIG["vocab_size"])
    executor = LocalExecutor(model=second_dir, num_gpu_blocks=64, max_model_len=512)
    try:
        tokens, logits = _forced_logits(executor, prompts)
    finally:
        executor.close()
    return prompts, tokens, logits


def test_tp1_fp8_logits_within_bound_of_full_precision(second_dir: str, full_precision) -> None:
    prompts, tokens, logits = full_precision
    executor = LocalExecutor(model=second_dir, num_gpu_blocks=64, max_model_len=512,
                             kv_cache_dtype="fp8")
    try:
        _, got = _forced_logits(executor, prompts, tokens)
    finally:
        executor.close()
    _assert_within_bound(got, logits)


def test_tp2_fp8_logits_within_bound_of_full_precision(second_dir: str, full_precision,
                                                       tp2_group) -> None:
    prompts, tokens, logits = full_precision
    tp2_group.init(model=second_dir, num_gpu_blocks=64, max_model_len=512,
                   num_gpu_blocks_override=64, swap_space=0.001, kv_cache_dtype="fp8_e4m3")
    try:
        _, got = _forced_logits(tp2_group, prompts, tokens)
    finally:
        tp2_group.shutdown_workers()
    _assert_within_bound(got, logits)


def test_fp8_swap_and_fork_give_the_tokens_without_them(second_dir: str) -> None:
    prompts = [list(range(40, 75)), list(range(300, 309)), list(range(600, 621))]

    def scenario(hooks: dict) -> dict[int, list[int]]:
        executor = LocalExecutor(model=second_dir, num_gpu_blocks=64, num_cpu_blocks=8,
                                 max_model_len=512, kv_cache_dtype="fp8")
        try:
            builder = PlanBuilder(block_size=16, num_gpu_blocks=64, num_cpu_blocks=8,
                                  token_budget=24)
            for p in prompts:
                builder.add(p, SamplingParams(temperature=0), max_tokens=12)
            return builder.run(executor, hooks=hooks)
        finally:
            executor.close()

    plain = scenario({6: lambda b: b.fork(1, seq_index=1)})
    moved = scenario({5: lambda b: b.swap_out(0), 7: lambda b: b.swap_in(0),
                      6: lambda b: b.fork(1, seq_index=1)})
    assert moved == plain and plain[3] == plain[1]


def test_triton_kernels_give_the_torch_kernels_logits(second_dir: str, full_precision) -> None:
    """The whole model on the Triton kernels (interpreter on CPU) with an FP8 cache: the KV
    write and attention kernels read and write it as the torch twins do."""
    prompts, tokens, _ = full_precision
    got = {}
    for backend in ("torch", "triton"):
        executor = LocalExecutor(model=second_dir, num_gpu_blocks=64, max_model_len=512,
                                 kv_cache_dtype="fp8", attention_backend=backend)
        try:
            got[backend] = _forced_logits(executor, prompts[:2], tokens)[1]
        finally:
            executor.close()
    for sid, ref in got["torch"].items():
        np.testing.assert_allclose(got["triton"][sid], ref, atol=2e-3, rtol=0)
