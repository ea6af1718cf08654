"""kvcache/transfer.py: a transfer's holds keep blocks from reuse until released, received
blocks join the prefix cache only once adopted, and every path leaves the reference counts as
they were (the invariant checker passes, every block free)."""

from __future__ import annotations

import pytest

from kvcache import KVCacheManager
from kvcache.hashing import prompt_block_hashes
from kvcache.transfer import abandon, adopt, hold_cached_prefix, release, reserve

BS = 4


def _kv(blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(blocks, 0, BS)


def _run_and_free(kv: KVCacheManager, seq_id: int, tokens: list[int]) -> None:
    kv.allocate_slots(seq_id, tokens, len(tokens))
    kv.free(seq_id)


def _all_free(kv: KVCacheManager) -> None:
    kv.check_invariants()
    assert kv.num_free_gpu_blocks == kv.num_gpu_blocks


def test_a_hold_keeps_a_finished_prompts_blocks_from_reuse_until_released() -> None:
    kv = _kv(4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    _run_and_free(kv, 0, prompt)
    hold = hold_cached_prefix(kv, prompt_block_hashes(prompt, BS))
    assert len(hold.blocks) == 2 and kv.num_free_gpu_blocks == 2
    with pytest.raises(ValueError, match="only 2 are free"):
        kv.gpu_pool.get_new_blocks(3)
    ids = hold.block_ids
    release(kv, hold)
    _all_free(kv)
    assert kv.lookup_prefix(prompt) == ids  # still cached after the hold


def test_adopted_blocks_are_hit_by_the_prompt_and_abandoned_ones_are_not() -> None:
    kv = _kv()
    prompt = list(range(200, 213))  # 3 full blocks + 1
    hashes = prompt_block_hashes(prompt, BS)
    cached, fresh = reserve(kv, hashes)
    assert cached.blocks == [] and len(fresh.blocks) == 3
    abandon(kv, cached, fresh)
    _all_free(kv)
    assert kv.lookup_prefix(prompt) == []
    cached, fresh = reserve(kv, hashes)
    ids = fresh.block_ids
    adopt(kv, cached, fresh, hashes)
    _all_free(kv)
    assert kv.lookup_prefix(prompt) == ids


def test_reserve_skips_the_blocks_already_cached() -> None:
    kv = _kv()
    prompt = list(range(300, 317))  # 4 full blocks + 1
    _run_and_free(kv, 0, prompt[:9])  # the first 2 blocks are cached here already
    hashes = prompt_block_hashes(prompt, BS)
    cached, fresh = reserve(kv, hashes)
    assert len(cached.blocks) == 2 and len(fresh.blocks) == 2
    adopt(kv, cached, fresh, hashes)
    _all_free(kv)
    assert len(kv.lookup_prefix(prompt)) == 4


def test_reserve_without_room_holds_nothing() -> None:
    kv = _kv(2)
    kv.allocate_slots(0, list(range(8)), 8)  # both blocks taken
    with pytest.raises(ValueError, match="free KV blocks needed"):
        reserve(kv, prompt_block_hashes(list(range(50, 58)), BS))
    kv.free(0)
    _all_free(kv)


def test_transfers_need_prefix_caching() -> None:
    kv = KVCacheManager(4, 0, BS, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="enable prefix caching"):
        hold_cached_prefix(kv, [])
