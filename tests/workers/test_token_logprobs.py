"""sampler.token_logprobs (prompt logprobs' values) against torch's log_softmax: row blocks of
any size (the CPU block and the last partial one), k = 0 (the token's value alone), k = 1 (max) and k > 1 (topk), bf16 logits
read without changing them, and ranks counted as 1 + the values strictly above the token's."""

from __future__ import annotations

import pytest
import torch

from workers import sampler
from workers.sampler import token_logprobs


def _reference(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    lsm = logits.float().log_softmax(-1)
    chosen = lsm.gather(1, targets.unsqueeze(1))
    ranks = (lsm > chosen).sum(1) + 1
    top, top_ids = lsm.topk(k, dim=-1)
    return chosen.squeeze(1), ranks, top_ids, top


@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("block_rows", [1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_equal_log_softmax_in_every_block(monkeypatch: pytest.MonkeyPatch,
                                                         k: int, block_rows: int,
                                                         dtype: torch.dtype) -> None:
    vocab = 1000
    monkeypatch.setattr(sampler, "CPU_LOGPROB_BLOCK_BYTES", block_rows * 4 * vocab)
    gen = torch.Generator().manual_seed(k * 100 + block_rows)
    logits = (torch.randn(10, vocab, generator=gen) * 4).to(dtype)
    before = logits.clone()
    targets = torch.randint(0, vocab, (10,), generator=gen)
    targets[0] = int(logits[0].float().argmax())  # one row whose token is the top one
    got = token_logprobs(logits, targets, k)
    want = _reference(logits, targets, k)
    assert torch.equal(logits, before)
    assert got.logprobs.dtype == got.top_logprobs.dtype == torch.float32
    assert torch.allclose(got.logprobs, want[0], atol=1e-5, rtol=0)
    assert torch.equal(got.ranks, want[1]) and int(got.ranks[0]) == 1
    assert torch.equal(got.top_token_ids, want[2])
    assert torch.allclose(got.top_logprobs, want[3], atol=1e-5, rtol=0)
    assert got.top_token_ids.shape == (10, k)


def test_token_logprobs_of_a_uniform_row_is_minus_log_vocab() -> None:
    logits = torch.zeros(2, 8)
    got = token_logprobs(logits, torch.tensor([3, 7]), 1)
    assert torch.allclose(got.logprobs, torch.full((2,), -torch.log(torch.tensor(8.0))))
    assert got.ranks.tolist() == [1, 1]  # nothing lies strictly above a tie


@pytest.mark.parametrize("vocab", [997, 1000, 151936 // 64])
def test_top1_is_max_with_its_first_column(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 4, (6, vocab), generator=gen).float()  # many ties at the top
    x[1, vocab - 1] = 9.0  # the last column
    x[2, 0] = 9.0  # the first column
    top, ids = sampler.top1(x)
    want_top, _ = x.max(dim=1, keepdim=True)
    first = (x == want_top).float().argmax(dim=1, keepdim=True)  # first maximal column
    assert torch.equal(top, want_top) and torch.equal(ids, first)
    assert ids[1, 0] == vocab - 1 and ids[2, 0] == 0
