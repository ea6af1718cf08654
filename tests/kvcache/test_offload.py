"""The CPU offload tier's bookkeeping (kvcache/offload.py) behind KVCacheManager."""

from __future__ import annotations

import pytest

from kvcache import KVCacheManager

BS = 2


def _fill(m: KVCacheManager, sid: int, prompt: list[int]) -> None:
    """A sequence computing its whole prompt, then freed (its full blocks stay cached)."""
    assert m.allocate_new(sid, prompt, len(prompt)) is not None
    m.free(sid)


def test_eviction_offloads_a_hashed_block_once_and_keeps_its_hash_findable() -> None:
    m = KVCacheManager(3, 0, BS, num_offload_blocks=4)
    _fill(m, 0, [1, 2, 3, 4, 5])  # blocks 0, 1 hashed; block 2 holds a partial block
    assert m.take_transfers() == ([], [])
    _fill(m, 1, [9, 9, 9, 9, 9, 9])  # takes the clean block 2, then evicts 1 and 0 (LRU)
    offloads, loads = m.take_transfers()
    assert offloads == [(1, 0), (0, 1)] and loads == []
    assert m.lookup_prefix([1, 2, 3, 4, 5]) == []
    assert m.lookup_offloaded([1, 2, 3, 4, 5], 0) == [1, 0]  # block order, tier ids
    # Loaded back, then evicted again: the tier already holds them, nothing is copied twice.
    assert m.allocate_new(2, [1, 2, 3, 4, 5], 1, offloaded_block_ids=[1, 0]) is not None
    offloads, loads = m.take_transfers()
    assert loads == [(1, m.block_table(2)[0]), (0, m.block_table(2)[1])]
    m.free(2)
    _fill(m, 3, [7, 7, 7, 7, 7, 7])  # evicts the GPU copies of [1, 2] and [3, 4]
    assert m.take_transfers() == ([], [])
    s = m.stats()
    assert (s.blocks_offloaded, s.blocks_loaded, s.external_prefix_hits) == (5, 2, 4)
    m.check_invariants()


def test_tier_is_lru_and_blocks_being_loaded_are_not_overwritten() -> None:
    m = KVCacheManager(2, 0, BS, num_offload_blocks=2)
    for sid, tok in enumerate((10, 20, 30, 40)):  # each evicts the one before
        _fill(m, sid, [tok, tok + 1, tok + 2])
    m.take_transfers()
    assert m.lookup_offloaded([10, 11, 12], 0) == []  # the oldest left the tier
    hit = m.lookup_offloaded([20, 21, 22], 0)
    assert len(hit) == 1
    # Loading it while the same step evicts the GPU's copy of [40, 41]: that offload must
    # take the other tier block, not the one being read.
    assert m.allocate_new(9, [20, 21, 22], 1, offloaded_block_ids=hit) is not None
    offloads, loads = m.take_transfers()
    assert [t for _, t in offloads] != hit and [t for t, _ in loads] == hit
    m.check_invariants()


def test_a_stale_tier_hit_is_refused() -> None:
    m = KVCacheManager(2, 0, BS, num_offload_blocks=1)
    _fill(m, 0, [1, 2, 3])
    _fill(m, 1, [5, 6, 7])
    hit = m.lookup_offloaded([1, 2, 3], 0)
    _fill(m, 2, [8, 8, 8])  # the one tier block now holds [5, 6]
    with pytest.raises(ValueError, match="offloaded block .* no longer holds this prompt's KV"):
        m.allocate_new(3, [1, 2, 3], 1, offloaded_block_ids=hit)


def test_bad_tier_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="enable prefix caching or give it no blocks"):
        KVCacheManager(4, 0, BS, enable_prefix_caching=False, num_offload_blocks=2)
    with pytest.raises(ValueError, match="num_offload_blocks must be >= 0"):
        KVCacheManager(4, 0, BS, num_offload_blocks=-1)
    with pytest.raises(ValueError, match="no offload tier"):
        KVCacheManager(4, 0, BS).allocate_new(0, [1, 2, 3], 1, offloaded_block_ids=[0])
