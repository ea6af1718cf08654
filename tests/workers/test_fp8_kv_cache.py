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
from kv_fp8_testlib import (
    forced_logits,
    fp8_logits_by_backend,
    step_errors,
    swap_and_fork_tokens,
)
from workers_testlib import SECOND_CONFIG, LocalExecutor, parity_prompts

import kernels
from cluster.engine.config import EngineConfig
from kernels import reference
from workers.cache_engine import CacheEngine
from workers.config import WorkerConfig
from workers.worker import Worker

F8 = torch.float8_e4m3fn
# Teacher-forced logits of the FP8-KV run vs the fp32-KV run, over max |logit| of the step:
# e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4) on K and V at scale 1.0; observed
# 0.042-0.056 on this random-weight model (tp 1 and tp 2).
FP8_LOGIT_BOUND = 0.1
NEW_TOKENS = 24


def _scales(k: float | list[float], v: float | list[float], heads: int = 1
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-KV-head scale vectors `[heads]` (a number: every head's)."""
    return tuple(torch.tensor(x if isinstance(x, list) else [x] * heads) for x in (k, v))


def test_write_stores_value_over_scale_saturated() -> None:
    k_cache, v_cache = torch.zeros(2, 4, 1, 4, dtype=F8), torch.zeros(2, 4, 1, 4, dtype=F8)
    key = torch.tensor([[[1.0, -3.0, 1000.0, 0.3]], [[9.0, 9.0, 9.0, 9.0]]])
    value = -key
    kernels.write_kv(key, value, k_cache, v_cache, torch.tensor([5, -1]), backend="torch",
                     k_scale=torch.tensor([2.0]), v_scale=torch.tensor([0.5]))  # [Hkv=1]
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
    # heads 30x apart in magnitude, each stored over its own scale
    k_full[:, :, 1] *= 30
    v_full[:, :, 0] *= 30
    k_scale, v_scale = _scales([0.05, 1.5], [0.3, 0.01])
    k8 = reference.quantize_kv(k_full, F8, k_scale)
    v8 = reference.quantize_kv(v_full, F8, v_scale)
    k_deq, v_deq = k8.float() * k_scale[:, None], v8.float() * v_scale[:, None]
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


@pytest.mark.parametrize(("backend", "scale_heads", "message"), [
    ("flash_attn", 2, r"the 'flash_attn' kernels do not read an FP8 KV cache"),
    ("torch", None, r"FP8 \(float8_e4m3fn\) KV cache needs k_scale and v_scale"),
    ("torch", 1, r"needs k_scale and v_scale, float32 \[Hkv=2\] \(one per KV head; fill it "
     r"for a per-tensor scale\); got \['torch.float32 \(1,\)', 'torch.float32 \(1,\)'\]"),
])
def test_kernels_refuse_what_they_cannot_read(backend: str, scale_heads: int | None,
                                              message: str) -> None:
    cache = torch.zeros(2, 4, 2, 4, dtype=F8)  # 2 KV heads
    extra = ({} if scale_heads is None
             else dict(zip(("k_scale", "v_scale"), _scales(1.0, 1.0, scale_heads))))
    with pytest.raises(ValueError, match=message):
        kernels.paged_attention(torch.zeros(1, 2, 4), cache, cache.clone(),
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


def _assert_within_bound(got: dict, want: dict) -> None:
    for sid, err in step_errors(got, want).items():
        assert err.max() <= FP8_LOGIT_BOUND, (sid, err.max())
        assert err.max() > 0  # the cache really is FP8


@pytest.fixture(scope="module")
def full_precision(second_dir: str) -> tuple[list, dict, dict]:
    prompts = parity_prompts(SECOND_CONFIG["vocab_size"])
    executor = LocalExecutor(model=second_dir, num_gpu_blocks=64, max_model_len=512)
    try:
        tokens, logits = forced_logits(executor, prompts, NEW_TOKENS)
    finally:
        executor.close()
    return prompts, tokens, logits


def test_tp1_fp8_logits_within_bound_of_full_precision(second_dir: str, full_precision) -> None:
    prompts, tokens, logits = full_precision
    executor = LocalExecutor(model=second_dir, num_gpu_blocks=64, max_model_len=512,
                             kv_cache_dtype="fp8")
    try:
        _, got = forced_logits(executor, prompts, NEW_TOKENS, tokens)
    finally:
        executor.close()
    _assert_within_bound(got, logits)


def test_tp2_fp8_logits_within_bound_of_full_precision(second_dir: str, full_precision,
                                                       tp2_group) -> None:
    prompts, tokens, logits = full_precision
    tp2_group.init(model=second_dir, num_gpu_blocks=64, max_model_len=512,
                   num_gpu_blocks_override=64, swap_space=0.001, kv_cache_dtype="fp8_e4m3")
    try:
        _, got = forced_logits(tp2_group, prompts, NEW_TOKENS, tokens)
    finally:
        tp2_group.shutdown_workers()
    _assert_within_bound(got, logits)


def test_fp8_swap_and_fork_give_the_tokens_without_them(second_dir: str) -> None:
    plain, moved = swap_and_fork_tokens(second_dir, kv_cache_dtype="fp8")
    assert moved == plain and plain[3] == plain[1]


def test_triton_kernels_give_the_torch_kernels_logits(second_dir: str, full_precision) -> None:
    """The whole model on the Triton kernels (interpreter on CPU) with an FP8 cache: the KV
    write and attention kernels read and write it as the torch twins do."""
    prompts, tokens, _ = full_precision
    got = fp8_logits_by_backend(second_dir, prompts[:2], NEW_TOKENS, tokens)
    for sid, ref in got["torch"].items():
        np.testing.assert_allclose(got["triton"][sid], ref, atol=2e-3, rtol=0)
