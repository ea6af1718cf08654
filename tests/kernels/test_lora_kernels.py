"""Batched LoRA shrink/expand (kernels.lora_shrink / lora_expand): the torch twin against a
per-token loop, the Triton kernels (interpreter on CPU, fp32, toy shapes) against the twin."""

from __future__ import annotations

import pytest
import torch

import kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(num_tokens: int, slots: int, rank: int, n_in: int, n_out: int, seed: int):
    """Adapters of rank `rank` in a stack of width `rank` rounded up to 8 (as the LoRA
    wrappers pad it), the padding zeros."""
    g = torch.Generator().manual_seed(seed)
    width = -(-rank // 8) * 8
    x = torch.randn(num_tokens, n_in, generator=g)
    a = torch.zeros(slots + 1, width, n_in)
    b = torch.zeros(slots + 1, n_out, width)
    # the last slot stays zero: what -1 (the base model) indexes
    a[:-1, :rank] = torch.randn(slots, rank, n_in, generator=g)
    b[:-1, :, :rank] = torch.randn(slots, n_out, rank, generator=g)
    token_slots = torch.randint(0, slots, (num_tokens,), generator=g)
    token_slots[::3] = -1  # base rows between them
    return [t.to(DEVICE) for t in (x, a, b, token_slots)]


def _per_token(x, a, b, token_slots):
    """The definition, one token at a time."""
    rows = []
    for t in range(x.shape[0]):
        s = int(token_slots[t])
        if s < 0:
            rows.append(torch.zeros(b.shape[1], device=x.device))
        else:
            rows.append(b[s] @ (a[s] @ x[t]))
    return torch.stack(rows)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_shrink_then_expand_adds_each_tokens_own_adapter(backend: str) -> None:
    # 600 input features: three shrink programs per token (the split over features)
    x, a, b, token_slots = _case(num_tokens=11, slots=3, rank=8, n_in=600, n_out=72, seed=0)
    assert (token_slots == -1).any() and (token_slots >= 0).any()
    base = torch.randn(11, 72, device=DEVICE)
    out = base.clone()
    y = kernels.lora_shrink(x, a, token_slots, backend=backend)
    kernels.lora_expand(y, b, token_slots, out, backend=backend)
    torch.testing.assert_close(out, base + _per_token(x, a, b, token_slots), rtol=1e-5, atol=1e-4)
    # base rows (slot -1) are exactly unchanged
    base_rows = token_slots == -1
    assert torch.equal(out[base_rows], base[base_rows])


@pytest.mark.parametrize("rank", [1, 5, 16])
def test_triton_matches_the_torch_twin_on_odd_ranks_and_widths(rank: int) -> None:
    x, a, b, token_slots = _case(num_tokens=7, slots=2, rank=rank, n_in=132, n_out=68, seed=rank)
    y_ref = kernels.lora_shrink(x, a, token_slots, backend="torch")
    y_tri = kernels.lora_shrink(x, a, token_slots, backend="triton")
    torch.testing.assert_close(y_tri, y_ref, rtol=1e-5, atol=1e-5)
    out_ref = torch.zeros(7, 68, device=DEVICE)
    out_tri = torch.zeros(7, 68, device=DEVICE)
    kernels.lora_expand(y_ref, b, token_slots, out_ref, backend="torch")
    kernels.lora_expand(y_ref, b, token_slots, out_tri, backend="triton")
    torch.testing.assert_close(out_tri, out_ref, rtol=1e-5, atol=1e-5)


def test_only_the_first_tokens_of_a_longer_slot_buffer_are_read() -> None:
    x, a, b, token_slots = _case(num_tokens=4, slots=2, rank=4, n_in=32, n_out=16, seed=9)
    buffer = torch.full((64,), 1, dtype=torch.int64, device=DEVICE)
    buffer[:4] = token_slots
    y = kernels.lora_shrink(x, a, buffer, backend="torch")
    torch.testing.assert_close(y, kernels.lora_shrink(x, a, token_slots, backend="torch"))


def test_bad_shapes_are_value_errors_naming_the_argument() -> None:
    x, a, b, token_slots = _case(num_tokens=4, slots=2, rank=4, n_in=32, n_out=16, seed=1)
    with pytest.raises(ValueError, match="token_slots must be int64"):
        kernels.lora_shrink(x, a, token_slots.to(torch.int32))
    with pytest.raises(ValueError, match=r"x must be \[T, 32\]"):
        kernels.lora_shrink(x[:, :16], a, token_slots)
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        kernels.lora_shrink(x, a[:, :3], token_slots)
    with pytest.raises(ValueError, match=r"out must be \[T=4, 16\]"):
        kernels.lora_expand(torch.zeros(4, 8, device=DEVICE), b, token_slots,
                            torch.zeros(4, 15, device=DEVICE))


def test_twin_regroups_when_the_same_slot_buffer_gets_new_slots() -> None:
    """The twin groups a step's slots once and reuses that for the step's other products; new
    slots written in place into the same buffer (the next step) are grouped again, and so are
    fewer tokens read from it."""
    x, a, b, _ = _case(num_tokens=9, slots=3, rank=8, n_in=40, n_out=24, seed=5)
    buffer = torch.full((16,), -1, dtype=torch.int64, device=DEVICE)  # LoRABatch.token_slots
    for step, (slots, n) in enumerate([([0, 1, 2, -1, 0, 1, 2, -1, 0], 9),
                                       ([2, 2, -1, 1, 0, 0, 1, 2, 2], 9),
                                       ([1, 0, -1, 2, 0, 0], 6)]):
        buffer[:len(slots)].copy_(torch.tensor(slots, device=DEVICE))
        for _ in range(2):  # the second product of the step reuses the grouping
            out = torch.zeros(n, 24, device=DEVICE)
            kernels.lora_expand(kernels.lora_shrink(x[:n], a, buffer, backend="torch"), b,
                                buffer, out, backend="torch")
            torch.testing.assert_close(out, _per_token(x[:n], a, b, buffer[:n]),
                                       rtol=1e-5, atol=1e-4, msg=f"step {step}")
