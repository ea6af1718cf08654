"""FP8 weights whose dims are not multiples of the 128x128 block (Qwen's format: ragged last
blocks, ceil-div scale grids), served as vLLM does (`validate_fp8_block_shape`): an unsplit dim
may end in a partial block; a dim split over the ranks must be whole blocks on every rank, and
a merged weight's parts but the last whole blocks (their scale rows line up), else refused
naming the sizes.

- A hidden size of 320 (2.5 blocks: the K of q/k/v, gate/up and the experts' w13, the N of
  o_proj, down and the experts' w2), dense and MoE, tp 1 and 2: logits within the W8A8 error
  of transformers on the dequantized weights, as test_fp8_weights.py checks whole blocks.
- An intermediate size of 1 mod 128 (257): down_proj's K ends in a one-column block and
  multiplies as the twin on the dequantized weight says; gate/up merged would misalign the up
  part's scale rows and is refused, as vLLM refuses it; a tp split inside a block is refused.
"""

from __future__ import annotations

import pytest
import torch
from fp8_testlib import FP8_DENSE_CONFIG, FP8_MOE_CONFIG
from test_fp8_weights import F8, _check_both_oracles, _greedy, _make, check_tp2_against_oracles
from workers_testlib import LocalExecutor

from kernels.fp8_reference import (
    dequantize_weight_blocks,
    fake_quantize_act_groups,
    quantize_weight_blocks,
)
from workers.distributed import TensorParallelGroup
from workers.layers import MergedColumnParallelLinear, RowParallelLinear
from workers.layers.moe import FusedMoE
from workers.model_config import load_model_config
from workers.quantization import Fp8Config

HIDDEN = 320
RAGGED_DENSE = {**FP8_DENSE_CONFIG, "hidden_size": HIDDEN}
RAGGED_MOE = {**FP8_MOE_CONFIG, "hidden_size": HIDDEN}


@pytest.fixture(scope="module", params=["dense", "moe"])
def ragged(request, tmp_path_factory: pytest.TempPathFactory) -> dict:
    config, seed = (RAGGED_MOE, 6) if request.param == "moe" else (RAGGED_DENSE, 5)
    return {**_make(tmp_path_factory.mktemp(f"ragged_{request.param}"), config, seed),
            "name": request.param}


def test_tp1_partial_hidden_blocks_within_w8a8_error(ragged: dict) -> None:
    executor = LocalExecutor(model=ragged["fp8"], num_gpu_blocks=64, max_model_len=512)
    try:
        layer = executor.worker.model.model.layers[0]
        assert layer.self_attn.qkv_proj.weight_scale_inv.shape == (8, 3)  # K: 2.5 blocks
        assert layer.self_attn.o_proj.weight_scale_inv.shape == (3, 4)  # N: 2.5 blocks
        if ragged["name"] == "moe":
            assert layer.mlp.w13_weight_scale_inv.shape == (4, 4, 3)
            assert layer.mlp.w2_weight_scale_inv.shape == (4, 3, 2)
        else:
            assert layer.mlp.down_proj.weight_scale_inv.shape == (3, 2)
        held = sum(p.numel() * p.element_size() for p in executor.worker.model.parameters())
        got = _greedy(executor, ragged["prompts"])
    finally:
        executor.close()
    assert held == load_model_config(ragged["fp8"]).weight_bytes_per_rank(1, 4)
    _check_both_oracles(got, ragged)


def test_tp2_partial_hidden_blocks_within_w8a8_error(ragged: dict, tp2_group) -> None:
    check_tp2_against_oracles(tp2_group, ragged)


def test_a_one_column_last_block_multiplies_as_the_twin_says() -> None:
    """down_proj of an intermediate size 257 = 2 x 128 + 1: its last K block is one column
    wide, with a scale of its own (quantized at load as Qwen's format stores it)."""
    g = torch.Generator().manual_seed(2)
    layer = RowParallelLinear(257, HIDDEN, TensorParallelGroup.single(), torch.float32,
                              Fp8Config(from_checkpoint=False))
    w = torch.randn(HIDDEN, 257, generator=g)
    w[:, 256] *= 1000  # the one-column block: far larger, yet no other block's scale moves
    layer.weight.data.copy_(w)
    layer.process_weights_after_loading()
    q, scale = quantize_weight_blocks(w, (128, 128))
    assert layer.weight.dtype == F8 and layer.weight_scale_inv.shape == (3, 3)
    assert torch.equal(layer.weight_scale_inv, scale)
    assert bool((scale[:, 2] > 100 * scale[:, 1]).all())
    x = torch.randn(5, 257, generator=g)
    want = fake_quantize_act_groups(x, 128) @ dequantize_weight_blocks(q, scale, (128, 128)).T
    torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(("build", "message"), [
    # merged gate/up of 257 rows each: up's scale rows would start inside gate's last block
    (lambda q: MergedColumnParallelLinear(HIDDEN, [257, 257], TensorParallelGroup(0, 1),
                                          torch.float32, q),
     r"one rank's MergedColumnParallelLinear part 0 is \[257, 320\] at tensor_parallel_size=1"
     r".*parts other than the last must be whole blocks"),
    (lambda q: FusedMoE(4, 2, HIDDEN, 257, True, TensorParallelGroup(0, 1), torch.float32,
                        "torch", quant=q),
     r"expert gate_proj/up_proj part 0 is \[257, 320\] at tensor_parallel_size=1"),
    # 2 x 192 input columns: each rank's 192 would split its second block
    (lambda q: RowParallelLinear(384, HIDDEN, TensorParallelGroup(0, 2), torch.float32, q),
     r"one rank's RowParallelLinear is \[320, 192\] at tensor_parallel_size=2, which splits "
     r"a scale block.*choose a smaller tensor_parallel_size"),
    (lambda q: MergedColumnParallelLinear(HIDDEN, [384, 384], TensorParallelGroup(1, 2),
                                          torch.float32, q),
     r"part 0 is \[192, 320\] at tensor_parallel_size=2"),
])
def test_splits_inside_a_block_are_refused_naming_the_sizes(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build(Fp8Config())


def test_unsplit_partial_blocks_are_accepted() -> None:
    """What vLLM accepts: a merged weight's last part, and an unsplit dim, ending partial."""
    quant = Fp8Config()
    qkv_like = MergedColumnParallelLinear(HIDDEN, [256, 200], TensorParallelGroup(0, 1),
                                          torch.float32, quant)
    assert qkv_like.weight_scale_inv.shape == (4, 3)
    row = RowParallelLinear(512, HIDDEN, TensorParallelGroup(1, 2), torch.float32, quant)
    assert row.weight_scale_inv.shape == (3, 2)
