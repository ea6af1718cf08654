"""FP8 weights (Qwen's block-scaled checkpoints and `quantization: fp8` at load), dense and MoE,
tp 1 and 2, against two transformers oracles on the dequantized weights (the checkpoint's e4m3
values times their scales, exactly):

* plain: the only difference is then the activations' per-token, per-128-group e4m3 rounding
  (3 mantissa bits) before each projection, which on these random models (logits' std ~1.5)
  moves a logit by up to ~0.3 (dense) or ~1.1 (MoE, whose experts' two GEMMs are W8A8 too,
  and where a router choice can flip): logits within W8A8_BOUND (1.0 dense, 1.5 MoE), greedy
  tokens equal wherever the oracle's top-2 gap exceeds twice it;
* W8A8: the same model with each projection's input (the MoE experts' two GEMMs' included)
  quantized and dequantized as the FP8 layers and the fused MoE kernels do
  (fp8_testlib.fake_quantize_activations): the same arithmetic up to fp32 summation
  order (the CPU attention path sums in another order than transformers' eager attention), so
  at least half of the steps' logits within EXACT = 1e-4 and every one within FLIP_BOUND =
  0.25, where that order moved an activation across an e4m3 rounding boundary (one step of 1/8
  of its binade) and the cached K/V keep the difference; greedy tokens equal wherever the
  oracle's top-2 gap exceeds twice FLIP_BOUND (a smaller gap can flip: seen at a first token
  whose logits moved by 0.12).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fp8_testlib import (
    FP8_DENSE_CONFIG,
    FP8_MOE_CONFIG,
    fake_quantize_activations,
    write_qwen_fp8,
)
from workers_testlib import LocalExecutor, PlanBuilder, hf_greedy, parity_prompts

import kernels
from kernels import fp8_reference
from kernels.fp8_reference import quantize_weight_blocks
from scheduler.sampling_params import SamplingParams
from workers.distributed import TensorParallelGroup
from workers.layers import MergedColumnParallelLinear, RowParallelLinear
from workers.layers.moe import FusedMoE
from workers.lora import LoRABatch, RowParallelLinearWithLoRA
from workers.model_config import load_model_config
from workers.quantization import Fp8Config
from workers.tiny_model import write_random_qwen3

W8A8_BOUND = {"dense": 1.0, "moe": 1.5}
EXACT = 1e-4
FLIP_BOUND = 0.25
NUM_TOKENS = 8
F8 = torch.float8_e4m3fn


def _make(tmp: Path, config: dict, seed: int) -> dict[str, str]:
    src = write_random_qwen3(tmp / "float", config, seed)
    write_qwen_fp8(src, tmp / "fp8", tmp / "dequant")
    prompts = parity_prompts(config["vocab_size"])
    return {"float": str(src), "fp8": str(tmp / "fp8"), "dequant": str(tmp / "dequant"),
            "prompts": prompts, "bound": W8A8_BOUND["moe" if config.get("num_experts") else
                                                    "dense"],
            "oracle": hf_greedy(str(tmp / "dequant"), prompts, NUM_TOKENS),
            "w8a8_oracle": hf_greedy(str(tmp / "dequant"), prompts, NUM_TOKENS,
                                     fake_quantize_activations)}


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _make(tmp_path_factory.mktemp("fp8_dense"), FP8_DENSE_CONFIG, 3)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _make(tmp_path_factory.mktemp("fp8_moe"), FP8_MOE_CONFIG, 4)


def _greedy(executor, prompts: list[list[int]]) -> list[tuple[list[int], np.ndarray]]:
    builder = PlanBuilder(block_size=16, num_gpu_blocks=64, token_budget=24)
    ids = [builder.add(p, SamplingParams(temperature=0), max_tokens=NUM_TOKENS) for p in prompts]
    outputs = builder.run(executor)
    return [(outputs[sid], np.stack(builder.seqs[sid].logits)) for sid in ids]


def _check_against_oracle(got: list[tuple[list[int], np.ndarray]], oracle: list,
                          bound: float) -> int:
    """Asserts the logits within `bound` over the steps whose contexts agree, and the tokens
    wherever the oracle's top-2 gap exceeds twice it; returns how many tokens were checked."""
    worst, compared, checked = 0.0, 0, 0
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, oracle):
        for t, (tok, ref_tok) in enumerate(zip(tokens, ref_tokens)):
            diff = float(np.abs(logits[t] - ref_logits[t]).max())
            assert diff <= bound, f"step {t}: logits differ by {diff}"
            worst = max(worst, diff)
            second, first = np.sort(ref_logits[t])[-2:]
            if first - second > 2 * bound:
                assert tok == ref_tok, f"step {t}: {tok} != {ref_tok} (top-2 gap {first - second})"
                checked += 1
            compared += 1
            if tok != ref_tok:
                break  # the contexts differ from here on
    assert compared >= 2 * len(got)
    assert worst > 0  # the activations really are quantized
    return checked


def _check_both_oracles(got: list, m: dict) -> None:
    _check_against_oracle(got, m["oracle"], m["bound"])
    assert _check_against_oracle(got, m["w8a8_oracle"], FLIP_BOUND) >= len(got)
    diffs = []  # over the steps whose contexts agree
    for (tokens, logits), (ref_tokens, ref_logits) in zip(got, m["w8a8_oracle"]):
        for t, (row, ref) in enumerate(zip(logits, ref_logits)):
            diffs.append(float(np.abs(row - ref).max()))
            if tokens[t] != ref_tokens[t]:
                break
    assert sum(d <= EXACT for d in diffs) >= len(diffs) // 2


def _decided_tokens_equal(got: list[list[int]], oracle: list, bound: float) -> None:
    """Each sequence's tokens equal the oracle's up to where they part, and they part only at
    a step whose oracle top-2 gap is within 2 x `bound` (a flip the error allows)."""
    for tokens, (ref_tokens, ref_logits) in zip(got, oracle):
        for t, (tok, ref_tok) in enumerate(zip(tokens, ref_tokens)):
            if tok != ref_tok:
                second, first = np.sort(ref_logits[t])[-2:]
                assert first - second <= 2 * bound, f"step {t}: {tok} != {ref_tok}"
                break


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_tp1_fp8_checkpoint_within_w8a8_error_of_transformers(name, request) -> None:
    m = request.getfixturevalue(name)
    executor = LocalExecutor(model=m["fp8"], num_gpu_blocks=64, max_model_len=512)
    try:
        model = executor.worker.model
        layer = model.model.layers[0]
        assert layer.self_attn.qkv_proj.weight.dtype == F8
        assert layer.self_attn.qkv_proj.weight_scale_inv.shape == ((512 + 256 + 256) // 128, 2)
        if name == "moe":
            assert layer.mlp.w13_weight.dtype == F8
            assert layer.mlp.w13_weight_scale_inv.shape == (4, 4, 2)
        got = _greedy(executor, m["prompts"])
    finally:
        executor.close()
    _check_both_oracles(got, m)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_tp2_fp8_checkpoint_within_w8a8_error_of_transformers(name, request, tp2_group) -> None:
    check_tp2_against_oracles(tp2_group, request.getfixturevalue(name))


def check_tp2_against_oracles(tp2_group, m: dict) -> None:
    """The FP8 checkpoint `m` at tp 2 against both oracles (`_check_both_oracles`)."""
    tp2_group.init(model=m["fp8"], num_gpu_blocks=64, max_model_len=512,
                   num_gpu_blocks_override=64, swap_space=0.001)
    try:
        got = _greedy(tp2_group, m["prompts"])
    finally:
        tp2_group.shutdown_workers()
    _check_both_oracles(got, m)


def test_online_quantization_equals_the_fp8_checkpoint(dense) -> None:
    """`quantization: fp8` over the float checkpoint quantizes exactly as Qwen's format does."""
    runs = []
    for model, quantization in ((dense["float"], "fp8"), (dense["fp8"], None)):
        executor = LocalExecutor(model=model, num_gpu_blocks=64, max_model_len=512,
                                 quantization=quantization)
        try:
            down = executor.worker.model.model.layers[1].mlp.down_proj
            assert down.weight.dtype == F8 and down.weight_scale_inv.shape == (2, 2)
            runs.append(_greedy(executor, dense["prompts"][:2]))
        finally:
            executor.close()
    for (tokens, logits), (want_tokens, want_logits) in zip(*runs):
        assert tokens == want_tokens
        np.testing.assert_array_equal(logits, want_logits)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_weight_bytes_count_fp8_before_the_kv_cache(name, request) -> None:
    """The bytes the start-up check counts are the loaded shard's, and the FP8 linear weights
    take a quarter of fp32's (one byte each, plus a float32 per 128x128 block)."""
    m = request.getfixturevalue(name)
    executor = LocalExecutor(model=m["fp8"], num_gpu_blocks=8, max_model_len=512)
    try:
        model = executor.worker.model
        held = sum(p.numel() * p.element_size() for p in model.parameters())
    finally:
        executor.close()
    fp8 = load_model_config(m["fp8"]).weight_bytes_per_rank(1, 4)
    full = load_model_config(m["float"]).weight_bytes_per_rank(1, 4)
    assert held == fp8
    linear = sum(p.numel() for n, p in model.named_parameters()
                 if n.endswith(("_proj.weight", "w13_weight", "w2_weight")))
    assert full - fp8 == linear * 3 - linear // (128 * 128) * 4
    # quantized at load: loading holds the float weights first, so the start-up check counts them
    assert load_model_config(m["float"], quantization="fp8").weight_bytes_per_rank(1, 4) == full


def test_tp_size_that_splits_a_scale_block_is_refused() -> None:
    quant = Fp8Config()
    with pytest.raises(ValueError, match=r"\[128, 128\] blocks: one rank's "
                                         r"MergedColumnParallelLinear part 0 is \[64, 256\] at "
                                         r"tensor_parallel_size=4, which splits a scale block"):
        MergedColumnParallelLinear(256, [256, 256], TensorParallelGroup(0, 4), torch.float32,
                                   quant)
    with pytest.raises(ValueError, match=r"expert gate_proj/up_proj part 0 is \[64, 256\] at "
                                         r"tensor_parallel_size=4"):
        FusedMoE(4, 2, 256, 256, True, TensorParallelGroup(0, 4), torch.float32, "torch",
                 quant=quant)
    with pytest.raises(ValueError, match=r"part 0 is \[64, 64\] at tensor_parallel_size=1.*"
                                         r"parts other than the last must be whole blocks"):
        MergedColumnParallelLinear(64, [64, 128], TensorParallelGroup(0, 1), torch.float32,
                                   quant)


def test_cpu_layer_dequantizes_its_weight_once_with_the_same_products() -> None:
    """On CPU an FP8 layer keeps its weight dequantized from load (the twin made it on every
    call): the products are the twin's bit for bit; the parameters stay e4m3 and scales."""
    g = torch.Generator().manual_seed(11)
    layer = MergedColumnParallelLinear(256, [256, 128], TensorParallelGroup(0, 1),
                                       torch.float32, Fp8Config(from_checkpoint=False))
    w = torch.randn(384, 256, generator=g)
    layer.weight.data.copy_(w)
    assert layer.weight_dequant is None  # (nothing to keep before the weights are in)
    layer.process_weights_after_loading()
    assert layer.weight.dtype == F8 and layer.weight_scale_inv.dtype == torch.float32
    q, scale = quantize_weight_blocks(w, (128, 128))
    want_w = fp8_reference.dequantize_weight_blocks(q, scale, (128, 128))
    assert layer.weight_dequant.dtype == torch.float32
    assert torch.equal(layer.weight_dequant, want_w)
    assert "weight_dequant" not in dict(layer.named_parameters())  # (not a checkpoint tensor)
    x = torch.randn(5, 256, generator=g)
    want = fp8_reference.fp8_block_linear(x, q, scale, (128, 128))  # dequantized per call
    assert torch.equal(layer.matmul(x), want)
    with pytest.raises(ValueError, match=r"dequantized must be the weight's shape \(384, 256\) "
                                         r"in torch.float32; got \(128, 256\)"):
        kernels.fp8_block_linear(x, q, scale, (128, 128), dequantized=want_w[:128])


def test_cpu_experts_dequantize_once_with_the_same_output() -> None:
    """The FP8 experts on CPU keep both stacks dequantized from load: the block's output is the
    torch path's that dequantizes on every call, bit for bit."""
    g = torch.Generator().manual_seed(12)
    moe = FusedMoE(4, 2, 256, 256, True, TensorParallelGroup(0, 1), torch.float32, "torch",
                   quant=Fp8Config(from_checkpoint=False))
    for p in (moe.w13_weight, moe.w2_weight, moe.gate.weight):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    assert moe.dequantized is None
    moe.process_weights_after_loading()
    assert moe.w13_weight.dtype == F8 and moe.w2_weight.dtype == F8
    w13, w2 = moe.dequantized
    assert w13.dtype == w2.dtype == torch.float32
    assert torch.equal(w13, fp8_reference.dequantize_weight_blocks(
        moe.w13_weight, moe.w13_weight_scale_inv, (128, 128), torch.float32))
    x = torch.randn(6, 256, generator=g)
    weights, ids = kernels.moe_route(moe.gate(x), 2, True)
    per_call = kernels.fused_moe(x, moe.w13_weight, moe.w2_weight, weights, ids,
                                 backend="torch", w13_scale=moe.w13_weight_scale_inv,
                                 w2_scale=moe.w2_weight_scale_inv, block=(128, 128))
    assert torch.equal(moe(x), per_call)
    with pytest.raises(ValueError, match=r"dequantized must be the weight's shape \(4, 512, "
                                         r"256\) in torch.float32; got .* in torch.bfloat16"):
        kernels.fused_moe(x, moe.w13_weight, moe.w2_weight, weights, ids, backend="torch",
                          w13_scale=moe.w13_weight_scale_inv, w2_scale=moe.w2_weight_scale_inv,
                          block=(128, 128), dequantized=(w13.to(torch.bfloat16), w2))


def test_lora_adds_its_product_over_an_fp8_base_layer() -> None:
    """A LoRA wrapper keeps the FP8 layer's own GEMM and adds x A^T B^T in the activations'
    dtype (its slots are float32 here, not e4m3); tp 2's rank 1 takes its columns of A."""
    g = torch.Generator().manual_seed(5)
    base = RowParallelLinear(512, 128, TensorParallelGroup(1, 2), torch.float32,
                             Fp8Config(from_checkpoint=False))
    w = torch.randn(128, 512, generator=g)
    base.weight.data.copy_(w[:, 256:])
    base.process_weights_after_loading()
    assert base.weight.dtype == F8
    slots = torch.tensor([0, -1], dtype=torch.int64)
    layer = RowParallelLinearWithLoRA(base, [("o_proj", None)], 1, 8,
                                      LoRABatch(slots, active=True, backend="torch"))
    assert layer.lora_a.dtype == torch.float32
    a, b = torch.randn(8, 512, generator=g), torch.randn(128, 8, generator=g)
    layer.set_slot(0, 0, {"layers.0.o_proj": (a.numpy(), b.numpy())})
    x = torch.randn(2, 256, generator=g)
    plain = base.matmul(x)
    q, scale = quantize_weight_blocks(w[:, 256:], (128, 128))
    assert torch.equal(base.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(base.weight_scale_inv, scale)
    out = layer.add_lora(x, base.matmul(x))  # (what forward all-reduces)
    torch.testing.assert_close(out[0], plain[0] + b @ (a[:, 256:] @ x[0]))
    assert torch.equal(out[1], plain[1])


def test_engine_serves_an_fp8_checkpoint_and_quantizes_at_load(dense) -> None:
    """Through `LLM.generate` (the engine's wiring of `quantization` and the checkpoint's
    config): the same greedy tokens from the FP8 checkpoint and from the float one with
    `quantization: fp8`, the W8A8 oracle's wherever its top-2 gap is beyond a flip."""
    from cluster import LLM

    prompts = [{"prompt_token_ids": p} for p in dense["prompts"][:2]]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    runs = []
    for model, quantization in ((dense["fp8"], None), (dense["float"], "fp8")):
        with LLM(model, device="cpu", max_model_len=512, quantization=quantization) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([list(o.outputs[0].token_ids) for o in outs])
    assert runs[0] == runs[1]  # quantized at load: the checkpoint's exact bytes
    _decided_tokens_equal(runs[0], dense["w8a8_oracle"][:2], FLIP_BOUND)
