import pytest

from kvcache import BlockPool, FreeBlockQueue, KVCacheBlock


def make_queue(n: int) -> tuple[list[KVCacheBlock], FreeBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeBlockQueue(blocks)


def test_free_queue_popleft_append_remove_are_in_order():
    blocks, q = make_queue(5)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    assert q.popleft().block_id == 0
    q.remove(blocks[2])
    assert q.block_ids() == [1, 3, 4]
    q.append(blocks[0])
    q.appendleft(blocks[2])
    assert q.block_ids() == [2, 1, 3, 4, 0]
    assert q.num_free_blocks == 5
    assert [b.block_id for b in q.popleft_n(3)] == [2, 1, 3]
    assert q.block_ids() == [4, 0]
    assert q.num_free_blocks == 2


def test_free_queue_remove_last_and_pop_everything():
    blocks, q = make_queue(3)
    q.remove(blocks[2])
    q.remove(blocks[0])
    assert q.block_ids() == [1]
    assert q.popleft().block_id == 1
    assert q.block_ids() == []
    with pytest.raises(ValueError, match="no free block"):
        q.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[1])
    with pytest.raises(ValueError, match="asked for 1 free blocks, only 0"):
        q.popleft_n(1)


def test_pool_allocates_clean_blocks_before_evicting_cached_ones():
    pool = BlockPool(4)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, b"h0" * 8)
    pool.free_blocks([b1, b0])  # b1 is clean -> head, b0 cached -> tail
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 0]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    assert pool.num_evictions == 0
    assert pool.get_cached_block(b"h0" * 8) is b0
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is b0 and b0.block_hash is None and b0.ref_cnt == 1
    assert pool.get_cached_block(b"h0" * 8) is None
    assert pool.num_evictions == 1
    pool.check_invariants()


def test_pool_cached_blocks_evicted_in_lru_order():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for b in blocks:
        pool.cache_block(b, bytes([b.block_id]) * 16)
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    assert [b.block_id for b in pool.get_new_blocks(1)] == [2]
    pool.touch([blocks[0]])  # a hit revives block 0 out of the middle of the queue
    assert pool.free_block_queue.block_ids() == [1]
    assert blocks[0].ref_cnt == 1 and blocks[0].block_hash == bytes([0]) * 16
    assert pool.num_evictions == 1
    pool.check_invariants()


def test_pool_map_holds_two_blocks_with_one_hash():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"x" * 16)
    pool.cache_block(b, b"x" * 16)
    assert pool.cached_block_hash_to_block[b"x" * 16] == {0: a, 1: b}
    pool.free_blocks([a])
    pool.check_invariants()
    assert [blk.block_id for blk in pool.get_new_blocks(2)] == [2, 0]
    assert pool.cached_block_hash_to_block[b"x" * 16] is b
    assert pool.get_cached_block(b"x" * 16) is b
    pool.check_invariants()


def test_pool_rejects_over_allocation_and_double_free():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="asked for 2 free blocks, only 1"):
        pool.get_new_blocks(2)
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([b])


def test_pool_invariant_checker_names_the_violation():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    b.ref_cnt = 0
    with pytest.raises(AssertionError, match="block 0 is neither free nor referenced"):
        pool.check_invariants()
    b.ref_cnt = 1
    b.block_hash = b"y" * 16
    with pytest.raises(AssertionError, match="hashed block 0 missing from the cache map"):
        pool.check_invariants()
