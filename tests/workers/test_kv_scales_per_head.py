"""Per-KV-head FP8 KV-cache scales from a checkpoint (llm-compressor's `k_scale` / `v_scale` with
one value per KV head), kept per head all the way into the kernels (workers/kv_scales.py).

The model: SECOND_CONFIG's weights with each KV head's V `HEAD_FACTORS[h]` times larger
(v_proj rows x f, the o_proj columns of that head's query heads / f: the same function),
so V's heads differ by 10x to 10^4x in magnitude. (K's heads cannot be made to differ so:
Qwen3's per-head k_norm, shared by the heads, sets their size.) Its scales are a calibration
of the full-precision run, per head: amax / 200 (K) and amax / 100 (V), vLLM's headroom.

Why 10^4: e4m3's relative step is the same across its normal range (2^-6 .. 448), so a head
stored over a scale 10-100x too large loses nothing until its values reach the subnormals;
with heads only 10-300x apart the per-tensor reduction measured as close as per-head scales
(max error 0.038-0.043 against 0.056, noise), at 3000x 0.060, at 10^4x 0.166 (per head:
0.056 in every case).

- Per-head scales keep the logits within FP8_LOGIT_BOUND of the fp32-KV run (teacher-forced),
  and at least PER_HEAD_GAIN times closer than the same checkpoint reduced to one scale per
  tensor (each layer's largest head's: what a per-tensor cache could use), at tp 1 and 2.
- The Triton kernels (interpreter) read the same per-head scales as the torch kernels.
- Swap, copy-on-write and shared (forked) blocks give the tokens of the run without them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from kv_fp8_testlib import (
    forced_logits,
    fp8_logits_by_backend,
    logit_error,
    swap_and_fork_tokens,
)
from safetensors.torch import load_file, save_file
from workers_testlib import SECOND_CONFIG, LocalExecutor, parity_prompts

from workers.kv_scales import K_SCALE_CONSTANT, V_SCALE_CONSTANT
from workers.tiny_model import write_random_qwen3

HEAD_FACTORS = (1.0, 10000.0, 10.0, 100.0)  # V's size per KV head
FP8_LOGIT_BOUND = 0.1  # relative to the step's max |logit| (test_fp8_kv_cache.py's)
PER_HEAD_GAIN = 2.0
NEW_TOKENS = 8
HEAD_DIM = SECOND_CONFIG["head_dim"]
GROUP = SECOND_CONFIG["num_attention_heads"] // SECOND_CONFIG["num_key_value_heads"]


def _uneven_heads(path: Path) -> Path:
    tensors = load_file(path / "model.safetensors")
    for name in list(tensors):
        for h, f in enumerate(HEAD_FACTORS):
            if name.endswith("self_attn.v_proj.weight"):
                tensors[name][h * HEAD_DIM:(h + 1) * HEAD_DIM] *= f
            elif name.endswith("self_attn.o_proj.weight"):
                cols = slice(h * GROUP * HEAD_DIM, (h + 1) * GROUP * HEAD_DIM)
                tensors[name][:, cols] /= f
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list, dict, dict, dict]:
    """(model dir, prompts, fp32-KV tokens, logits, per-head scale tensors by name)."""
    model = str(_uneven_heads(write_random_qwen3(tmp_path_factory.mktemp("kvh") / "m",
                                                 SECOND_CONFIG, 7)))
    prompts = parity_prompts(SECOND_CONFIG["vocab_size"])[:3]
    executor = LocalExecutor(model=model, num_gpu_blocks=64, max_model_len=512)
    amax: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module, args, output) -> None:  # Attention.forward(q, k, v, metadata)
            for kind, rows in (("k", args[1]), ("v", args[2])):
                key = f"{name}.{kind}_scale"
                per_head = rows.abs().amax(dim=(0, 2))
                amax[key] = per_head if key not in amax else torch.maximum(amax[key], per_head)
        return hook

    try:
        for i, layer in enumerate(executor.worker.model.model.layers):
            layer.self_attn.attn.register_forward_hook(record(f"model.layers.{i}.self_attn"))
        tokens, logits = forced_logits(executor, prompts, NEW_TOKENS)
    finally:
        executor.close()
    scales = {name: a / (K_SCALE_CONSTANT if name.endswith("k_scale") else V_SCALE_CONSTANT)
              for name, a in amax.items()}
    return model, prompts, tokens, logits, scales


def _checkpoint(calibrated, tmp_path: Path, per_head: bool) -> str:
    """The model with its calibrated scales: per head, or each reduced to its largest."""
    model, _, _, _, scales = calibrated
    ckpt = tmp_path / ("per_head" if per_head else "per_tensor")
    ckpt.mkdir()
    for f in Path(model).iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    tensors = load_file(ckpt / "model.safetensors")
    tensors.update({name: s if per_head else s.max() for name, s in scales.items()})
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    return str(ckpt)


def _fp8_error(ckpt: str, calibrated, **config) -> tuple[float, list]:
    _, prompts, tokens, logits, _ = calibrated
    executor = LocalExecutor(model=ckpt, num_gpu_blocks=64, max_model_len=512,
                             kv_cache_dtype="fp8", **config)
    try:
        _, got = forced_logits(executor, prompts, NEW_TOKENS, tokens)
        scales = [(a.k_scale.tolist(), a.v_scale.tolist())
                  for a in executor.worker.model.attention_layers()]
    finally:
        executor.close()
    return logit_error(got, logits), scales


def test_heads_really_differ_by_their_factors(calibrated) -> None:
    v = calibrated[4]["model.layers.0.self_attn.v_scale"]
    ratio = (v / v[0]).tolist()
    assert all(f / 3 < r < f * 3 for r, f in zip(ratio, HEAD_FACTORS, strict=True)), ratio


def test_per_head_scales_beat_the_per_tensor_reduction(calibrated, tmp_path: Path) -> None:
    per_head, scales = _fp8_error(_checkpoint(calibrated, tmp_path, True), calibrated)
    per_tensor, reduced = _fp8_error(_checkpoint(calibrated, tmp_path, False), calibrated)
    want = calibrated[4]
    for i, (k, v) in enumerate(scales):  # the checkpoint's vectors reach the kernels' buffers
        assert np.allclose(k, want[f"model.layers.{i}.self_attn.k_scale"], rtol=1e-6, atol=0)
        assert np.allclose(v, want[f"model.layers.{i}.self_attn.v_scale"], rtol=1e-6, atol=0)
        assert len(set(reduced[i][1])) == 1
    assert per_head <= FP8_LOGIT_BOUND
    assert per_head * PER_HEAD_GAIN <= per_tensor, (per_head, per_tensor)


def test_tp2_ranks_take_their_heads_scales(calibrated, tmp_path: Path, tp2_group) -> None:
    _, prompts, tokens, logits, scales = calibrated
    ckpt = _checkpoint(calibrated, tmp_path, True)
    tp2_group.init(model=ckpt, num_gpu_blocks=64, max_model_len=512,
                   num_gpu_blocks_override=64, swap_space=0.001, kv_cache_dtype="fp8")
    try:
        _, got = forced_logits(tp2_group, prompts, NEW_TOKENS, tokens)
        ranks = [state["kv_scales"] for state in tp2_group.state()]
    finally:
        tp2_group.shutdown_workers()
    for rank, layers in enumerate(ranks):
        heads = slice(2 * rank, 2 * rank + 2)
        for i, (k, v) in enumerate(layers):
            assert np.allclose(k, scales[f"model.layers.{i}.self_attn.k_scale"][heads],
                               rtol=1e-6, atol=0)
            assert np.allclose(v, scales[f"model.layers.{i}.self_attn.v_scale"][heads],
                               rtol=1e-6, atol=0)
    assert logit_error(got, logits) <= FP8_LOGIT_BOUND


def test_triton_kernels_read_the_per_head_scales(calibrated, tmp_path: Path) -> None:
    """The Triton prologue and attention (interpreter) against the torch kernels, same
    checkpoint: within 2e-3 of the step's max |logit| (K/V rounding ties may differ)."""
    _, prompts, tokens, _, _ = calibrated
    ckpt = _checkpoint(calibrated, tmp_path, True)
    got = fp8_logits_by_backend(ckpt, prompts[:1], NEW_TOKENS, tokens)
    assert logit_error(got["triton"], got["torch"]) <= 2e-3


def test_swap_and_forked_blocks_give_the_tokens_without_them(calibrated,
                                                               tmp_path: Path) -> None:
    plain, moved = swap_and_fork_tokens(_checkpoint(calibrated, tmp_path, True),
                                        kv_cache_dtype="fp8")
    assert moved == plain and plain[3] == plain[1]
