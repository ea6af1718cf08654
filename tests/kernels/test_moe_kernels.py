"""Fused MoE: the torch twin against a per-expert loop (transformers' Qwen3MoeExperts
algorithm), the block alignment's invariants, and the Triton kernel against the twin under
TRITON_INTERPRET=1 (fp32: the interpreter gets bf16 `tl.dot` wrong).

Cases cover expert counts 3..8, top-k 1..3, 1 and 3 tokens and more tokens than one
BLOCK_M tile, experts that get no token, and pairs of another rank's experts (id -1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import INTERPRETER_ONLY, run_sm90_compile

from kernels import ops
from kernels.moe_reference import moe_align_block_size


def per_expert_loop(x, w13, w2, weights, ids):
    """One expert at a time, as transformers' Qwen3MoeExperts.forward."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel():
            h = x[tok] @ w13[e].T
            y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].T
            out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


def make_case(num_tokens, num_experts, top_k, hidden=32, inter=24, seed=0, skip_expert=None,
              remote=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if skip_expert is not None:
        logits[:, skip_expert] = -1e9
    weights, ids = ops.moe_route(logits, top_k, renormalize=True)
    if remote:  # the first slot of every other token lives on another rank
        ids[::2, 0] = -1
    return x, w13, w2, weights, ids


CASES = [  # (tokens, experts, top_k)
    (1, 4, 2), (3, 8, 3), (3, 3, 1), (40, 6, 2), (70, 8, 2),
]


@pytest.mark.parametrize("num_tokens,num_experts,top_k", CASES)
@pytest.mark.parametrize("remote", [False, True], ids=["local", "ep"])
def test_reference_matches_per_expert_loop(num_tokens, num_experts, top_k, remote) -> None:
    x, w13, w2, weights, ids = make_case(num_tokens, num_experts, top_k, skip_expert=1,
                                         remote=remote)
    assert not (ids == 1).any()
    got = ops.fused_moe(x, w13, w2, weights, ids, backend="torch")
    torch.testing.assert_close(got, per_expert_loop(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


def test_route_matches_transformers_router() -> None:
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    for renorm in (True, False):
        cfg = Qwen3MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=3,
                             norm_topk_prob=renorm)
        router = Qwen3MoeTopKRouter(cfg)
        torch.nn.init.normal_(router.weight)
        h = torch.randn(9, 16)
        with torch.no_grad():
            logits, want_w, want_ids = router(h)
        got_w, got_ids = ops.moe_route(logits, 3, renorm)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, atol=0, rtol=0)


@pytest.mark.parametrize("block_m", [4, 16])
def test_align_groups_every_pair_once_in_its_experts_blocks(block_m: int) -> None:
    ids = torch.tensor([[2, 0], [2, -1], [0, 2], [3, 2], [-1, 0]])
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, num_experts=5, block_m=block_m)
    num_pairs = ids.numel()
    used = int(num_padded)
    assert used % block_m == 0 and sorted_ids.numel() % block_m == 0
    real = sorted_ids[sorted_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # each pair exactly once
    assert (sorted_ids[used:] == num_pairs).all()  # nothing past the used rows
    flat = ids.flatten()
    for b in range(used // block_m):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < num_pairs]
        want = int(expert_ids[b])
        assert rows.numel() > 0
        assert set(flat[rows].tolist()) == {want if want >= 0 else -1}
    # Sizes depend on (pairs, experts, block_m) alone, never on the routing (no host read,
    # and a CUDA graph captured for one batch replays for every other).
    other = moe_align_block_size(torch.zeros_like(ids), num_experts=5, block_m=block_m)
    assert [t.shape for t in other] == [sorted_ids.shape, expert_ids.shape, num_padded.shape]
    # Experts 1 and 4 got no pair: no block names them.
    assert not ({1, 4} & set(expert_ids.tolist()))
    assert (expert_ids[used // block_m:] == -1).all()


@INTERPRETER_ONLY
@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m",
                         [(1, 2, 4, 16), (3, 3, 8, 16), (70, 2, 6, 16), (300, 8, 128, 64),
                          (1500, 2, 8, 32)])
def test_triton_align_matches_reference(num_tokens, top_k, num_experts, block_m) -> None:
    """Same sizes, block experts and rows in use; each block holds the same pairs (their
    order inside an expert follows the GPU's atomics, so it is compared as a set)."""
    from kernels.triton_moe import moe_align_block_size as triton_align

    g = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k]
                       for _ in range(num_tokens)])
    ids[::3, 0] = -1
    want, got = moe_align_block_size(ids, num_experts, block_m), triton_align(ids, num_experts,
                                                                             block_m)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert got[0].shape == want[0].shape
    for b in range(want[1].numel()):
        rows = slice(b * block_m, (b + 1) * block_m)
        assert sorted(got[0][rows].tolist()) == sorted(want[0][rows].tolist())


@INTERPRETER_ONLY
@pytest.mark.parametrize("num_tokens,num_experts,top_k", CASES)
@pytest.mark.parametrize("remote", [False, True], ids=["local", "ep"])
def test_triton_matches_reference(num_tokens, num_experts, top_k, remote) -> None:
    x, w13, w2, weights, ids = make_case(num_tokens, num_experts, top_k, seed=3, skip_expert=0,
                                         remote=remote)
    want = ops.fused_moe(x, w13, w2, weights, ids, backend="torch")
    got = ops.fused_moe(x, w13, w2, weights, ids, backend="triton")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@INTERPRETER_ONLY
def test_triton_more_rows_than_a_tile_with_odd_sizes() -> None:
    """Forced 16-row tiles and a K loop with a ragged tail (hidden 40 over BLOCK_K 16):
    70 tokens * 2 slots span many blocks per expert; columns not a multiple of BLOCK_N."""
    from kernels.triton_moe import fused_moe as triton_fused_moe

    x, w13, w2, weights, ids = make_case(70, 5, 2, hidden=40, inter=20, seed=4)
    want = ops.fused_moe(x, w13, w2, weights, ids, backend="torch")
    got = triton_fused_moe(x, w13, w2, weights, ids, tiles=(16, 16, 16, 2, 4, 1))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_value_errors() -> None:
    x, w13, w2, weights, ids = make_case(3, 4, 2)
    with pytest.raises(ValueError, match="w13 must be"):
        ops.fused_moe(x, w13[:, :-1], w2, weights, ids)
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        ops.fused_moe(x, w13, w2, weights[:2], ids)
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_route(torch.zeros(3, 4), 5, True)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 300, 4096])
def test_triton_on_cuda_at_qwen3_30b_a3b_shapes_bf16(num_tokens: int) -> None:
    """Hidden 2048, 128 experts, 8 active, intermediate 384 (768 at tp 2), the table's tiles."""
    x, w13, w2, weights, ids = (t.cuda() for t in make_case(
        num_tokens, 128, 8, hidden=2048, inter=384, seed=8))
    x, w13, w2 = x.bfloat16(), (w13 * 0.2).bfloat16(), (w2 * 0.2).bfloat16()
    want = per_expert_loop(x.float(), w13.float(), w2.float(), weights, ids)
    got = ops.fused_moe(x, w13, w2, weights.bfloat16(), ids)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_triton_moe_is_captured_by_a_cuda_graph() -> None:
    """No host sync: the whole path (route, align, both GEMMs) replays from a graph with new
    router logits and gives the eager result."""
    x, w13, w2, _, _ = (t.cuda() for t in make_case(16, 8, 2, hidden=64, inter=32, seed=9))
    logits = torch.randn(16, 8, device="cuda")

    def step():
        weights, ids = ops.moe_route(logits, 2, True)
        return ops.fused_moe(x, w13, w2, weights, ids)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    logits.copy_(torch.randn(16, 8, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, step(), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_kernel_compiles_for_h100_at_every_table_tile(tmp_path) -> None:
    """Without a GPU, every tile of the table passes Triton, LLVM and ptxas for sm_90 and
    fits an H100's shared memory."""
    run_sm90_compile("sm90_compile_moe.py", tmp_path)
