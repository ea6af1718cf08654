"""A bf16 model on CPU multiplies oneDNN-packed weights (kernels/cpu_linear.py) in every
linear layer and its LM head, and generates what the unpacked path (`F.linear`) generates.

The same worker runs the same batch twice: packed, then with every packed copy dropped (the
layers fall back to `F.linear` on the same weights). On this project's CI CPU the two agree bit
for bit (both end in oneDNN's bf16 GEMM); the tolerance leaves room for another CPU's kernels to
sum in another order, within bf16's rounding of this model's logits (magnitudes up to ~4).
"""

from __future__ import annotations

import numpy as np
import pytest
from workers_testlib import NUM_GREEDY_TOKENS, LocalExecutor, PlanBuilder, parity_prompts

from scheduler.sampling_params import SamplingParams
from workers.layers import ParallelLMHead
from workers.layers.linear import LinearBase

# bf16 keeps 8 bits of mantissa: logits of magnitude ~1 differ by a few of their 2^-8 steps.
LOGIT_ATOL = 0.05


def _packable(model) -> list:
    return [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead))]


def _greedy(executor: LocalExecutor, vocab_size: int) -> tuple[dict, PlanBuilder]:
    builder = PlanBuilder(block_size=16, num_gpu_blocks=64, token_budget=24)
    ids = [builder.add(p, SamplingParams(temperature=0), max_tokens=NUM_GREEDY_TOKENS)
           for p in parity_prompts(vocab_size)]
    outputs = builder.run(executor)
    return {sid: outputs[sid] for sid in ids}, builder


@pytest.mark.parametrize("name", ["second", "single_kv"])  # untied and tied LM head
def test_bf16_model_packs_every_linear_layer_and_the_lm_head(name, model_dirs) -> None:
    ex = LocalExecutor(model=model_dirs[name], dtype="bfloat16", num_gpu_blocks=64,
                       max_model_len=512)
    try:
        layers = _packable(ex.worker.model)
        assert len(layers) > 4
        assert all(m.weight_packed is not None and m.weight_packed.is_mkldnn for m in layers)
        assert all(m.weight_packed.shape == m.weight.shape for m in layers)
    finally:
        ex.close()


def test_fp32_model_keeps_plain_weights(model_dirs) -> None:
    ex = LocalExecutor(model=model_dirs["second"], num_gpu_blocks=64, max_model_len=512)
    try:
        assert all(m.weight_packed is None for m in _packable(ex.worker.model))
    finally:
        ex.close()


def test_bf16_packed_generation_matches_the_unpacked_path(model_dirs) -> None:
    ex = LocalExecutor(model=model_dirs["second"], dtype="bfloat16", num_gpu_blocks=64,
                       max_model_len=512)
    try:
        vocab = ex.worker.model.lm_head.num_embeddings
        packed_out, packed = _greedy(ex, vocab)
        for m in _packable(ex.worker.model):
            m.weight_packed = None
        plain_out, plain = _greedy(ex, vocab)
    finally:
        ex.close()
    assert packed_out == plain_out
    for sid in packed_out:
        np.testing.assert_allclose(np.stack(packed.seqs[sid].logits),
                                   np.stack(plain.seqs[sid].logits), atol=LOGIT_ATOL, rtol=0)
