"""A decode step launches at most 10 kernels per decoder layer, GEMMs included.

Counted at the dispatch point by bench/launch_counter.py's `LaunchCounter` (every Triton launch,
every torch op that computes) while one decoder layer of a small Qwen3 runs a decode step with
the Triton backend under the interpreter. The GPU bench reports the same count at Qwen3-0.6B's
shapes, and torch.profiler's count of the kernels that really ran.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from kernel_cases import INTERPRETER_ONLY, load_launch_counter

launch_counter = load_launch_counter()
pytestmark = INTERPRETER_ONLY
SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
GEMMS = {"gemm": 4}  # qkv_proj, o_proj, gate_up_proj, down_proj
FUSED = {"triton._rms_norm_kernel": 2, "triton._qk_norm_rope_kernel": 1,
         "triton._paged_attention_kernel": 1, "triton._silu_and_mul_kernel": 1}


@pytest.mark.parametrize(("batch", "max_seq_len", "split"), [(4, 40, False), (3, 4096, True)])
def test_decode_layer_launches_at_most_ten_kernels(batch: int, max_seq_len: int,
                                                   split: bool) -> None:
    # max_seq_len 4096 is how a decode CUDA graph is captured (max_model_len): split-K, so the
    # segment merge is the tenth launch.
    cfg = launch_counter.model_config(**SMALL)
    counter = launch_counter.count_layer_launches(cfg, batch, 37, torch.float32,
                                                 torch.device("cpu"), "triton", max_seq_len)
    expected = Counter({**GEMMS, **FUSED})
    if split:
        expected["triton._merge_segments_kernel"] = 1
    assert Counter(counter.launches) == expected, counter.launches
    assert len(counter.launches) <= 10
    assert counter.host_reads == []  # capturable: nothing reads tensor values on the host


def test_triton_layer_equals_torch_layer() -> None:
    """The layer the launches are counted on computes what the torch twins compute."""
    cfg = launch_counter.model_config(**SMALL)
    outs = {}
    for backend in ("triton", "torch"):
        _, step = launch_counter.build_decode_layer(cfg, 4, 37, torch.float32,
                                                   torch.device("cpu"), backend, 4096)
        with torch.inference_mode():
            outs[backend] = step()
    for got, expected in zip(outs["triton"], outs["torch"]):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
