"""workers/kv_transfer.py: a payload carries exactly the named blocks of every layer, K and V,
whatever the runs of ids, and lands in other ids of another cache untouched elsewhere."""

from __future__ import annotations

import pytest
import torch

from workers.kv_transfer import PayloadLayout, block_runs, pack_blocks, unpack_blocks


def _cache(num_blocks: int = 10, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, 3, num_blocks, 4, 2, 8), generator=g)


def test_block_runs_split_at_every_gap() -> None:
    assert block_runs([]) == []
    assert block_runs([4, 5, 6]) == [(4, 3)]
    assert block_runs([7, 2, 3, 9, 10, 11, 0]) == [(7, 1), (2, 2), (9, 3), (0, 1)]


@pytest.mark.parametrize("src,dst", [
    ([2, 3, 4], [5, 6, 7]),  # one run each: strided slices
    ([8, 1, 2, 6], [0, 9, 3, 4]),  # scattered: index_select / index_copy_
])
def test_unpack_of_pack_moves_exactly_those_blocks(src: list[int], dst: list[int]) -> None:
    a, b = _cache(seed=1), _cache(seed=2)
    before = b.clone()
    payload = pack_blocks(a, src)
    assert payload.is_contiguous() and payload.shape == (2, 3, len(src), 4, 2, 8)
    unpack_blocks(b, dst, payload)
    for s, d in zip(src, dst):
        assert torch.equal(b[:, :, d], a[:, :, s])
    untouched = [i for i in range(10) if i not in dst]
    assert torch.equal(b[:, :, untouched], before[:, :, untouched])


def test_a_payload_of_another_layout_is_refused_before_any_write() -> None:
    a = _cache()
    other = torch.zeros((2, 3, 10, 4, 1, 8))  # half the KV heads: another TP size
    before = other.clone()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        unpack_blocks(other, [0, 1], pack_blocks(a, [0, 1]))
    assert torch.equal(other, before)
    assert PayloadLayout.of(a) != PayloadLayout.of(other)


def test_out_of_range_ids_and_counts_are_errors() -> None:
    a = _cache()
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        pack_blocks(a, [3, 10])
    with pytest.raises(ValueError, match="holds 2 blocks, 3 ids"):
        unpack_blocks(a, [0, 1, 2], pack_blocks(a, [4, 5]))


@pytest.mark.parametrize("ids", [[2, 3, 4], [8, 1, 6]])
def test_a_device_payload_is_a_contiguous_copy_not_a_view(ids: list[int]) -> None:
    """(Ray Direct Transport's: it stays on the cache's device, and a later write to the
    blocks, once they are freed, must not change what the decode side receives.)"""
    cache = _cache()
    payload = pack_blocks(cache, ids, to_host=False)
    assert payload.device == cache.device and payload.is_contiguous()
    assert torch.equal(payload, pack_blocks(cache, ids))
    cache.zero_()
    assert payload.abs().sum() > 0
