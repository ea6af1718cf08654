import pytest

from kvcache import Allocation, KVCacheManager

A = list(range(100, 112))  # three blocks of 4
B = list(range(200, 212))


def mgr(gpu: int = 8, cpu: int = 4, bs: int = 4, **kw) -> KVCacheManager:
    return KVCacheManager(num_gpu_blocks=gpu, num_cpu_blocks=cpu, block_size=bs, **kw)


def test_allocate_prompt_then_decode_grows_one_block_per_block_size():
    m = mgr()
    assert m.allocate_slots(1, A[:6], 6) == Allocation([0, 1], [])
    assert m.num_slots(1) == 6 and m.block_table(1) == [0, 1]
    assert m.allocate_slots(1, A[:7], 1) == Allocation([], [])
    assert m.allocate_slots(1, A[:8], 1) == Allocation([], [])
    assert m.allocate_slots(1, A[:9], 1) == Allocation([2], [])
    assert m.block_table(1) == [0, 1, 2] and m.num_free_gpu_blocks == 5
    m.check_invariants()


def test_num_blocks_needed_counts_new_cow_and_revived_prefix_blocks():
    m = mgr()
    assert m.num_blocks_needed(7, 9) == 3
    m.allocate_slots(1, A, 12)
    m.free(1)
    prefix = m.lookup_prefix(A + [5])
    assert prefix == [0, 1, 2]
    assert m.num_blocks_needed(2, 1, prefix) == 4  # 1 new + 3 revived from the free queue
    assert m.allocate_new(3, A[:6], 2, m.lookup_prefix(A[:6])) == Allocation([3], [])
    assert m.block_table(3) == [0, 3] and m.num_slots(3) == 6
    assert m.num_blocks_needed(3, 2) == 0
    assert m.num_blocks_needed(3, 3) == 1
    m.fork(3, 4)
    assert m.num_blocks_needed(4, 2) == 1  # copy-on-write of the shared partial block
    assert m.num_blocks_needed(4, 3) == 2


def test_prefix_hit_revives_freed_blocks_and_counts_stats():
    m = mgr()
    m.allocate_slots(1, A, 12)
    m.free(1)
    assert m.num_free_gpu_blocks == 8
    prompt = A + [7, 8]
    before = m.stats()
    prefix = m.lookup_prefix(prompt)
    assert prefix == [0, 1, 2]
    assert m.stats() == before  # lookup has no side effects
    assert (before.prefix_queries, before.prefix_hits) == (12, 0)
    alloc = m.allocate_new(2, prompt, 2, prefix)
    assert alloc == Allocation([3], [])
    assert m.block_table(2) == [0, 1, 2, 3] and m.num_slots(2) == 14
    s = m.stats()
    assert (s.prefix_queries, s.prefix_hits, s.evictions) == (26, 12, 0)
    assert s.num_free_gpu_blocks == 4 and s.gpu_usage == 0.5
    m.check_invariants()


def test_lookup_never_covers_the_last_token():
    m = mgr()
    m.allocate_slots(1, A, 12)
    assert m.lookup_prefix(A) == [0, 1]
    assert m.lookup_prefix(A[:9]) == [0, 1]
    assert m.lookup_prefix(A[:8]) == [0]
    assert m.lookup_prefix(A[:4]) == []
    assert m.lookup_prefix([]) == []
    with pytest.raises(ValueError, match="cover the last token"):
        m.allocate_new(2, A, 0, [0, 1, 2])


def test_lookup_stops_at_first_miss_and_respects_extra_key():
    m = mgr()
    m.allocate_new(1, A, 12, extra_key=b"salt")
    assert m.lookup_prefix(A + [1]) == []
    assert m.lookup_prefix(A + [1], extra_key=b"salt") == [0, 1, 2]
    assert m.lookup_prefix(A[:4] + B[4:] + [1], extra_key=b"salt") == [0]
    assert m.lookup_prefix(B[:4] + A[4:] + [1], extra_key=b"salt") == []


def test_disabled_prefix_caching_hashes_nothing():
    m = mgr(enable_prefix_caching=False)
    m.allocate_slots(1, A, 12)
    assert m.lookup_prefix(A + [1]) == []
    assert m.gpu_pool.cached_block_hash_to_block == {}
    with pytest.raises(ValueError, match="prefix caching is disabled"):
        m.allocate_new(2, A, 1, [0])
    m.check_invariants()


def test_blocks_filled_during_decode_become_cached():
    m = mgr()
    m.allocate_slots(1, A[:3], 3)
    assert m.lookup_prefix(A[:5]) == []
    m.allocate_slots(1, A[:4], 1)
    assert m.lookup_prefix(A[:5]) == [0]
    for n in range(5, 9):
        m.allocate_slots(1, A[:n], 1)
    assert m.lookup_prefix(A[:9]) == [0, 1]
    m.check_invariants()


def test_eviction_prefers_clean_blocks_then_least_recently_freed():
    m = mgr(gpu=4)
    m.allocate_slots(1, A[:8], 8)  # blocks 0, 1 (cached)
    m.free(1)  # tail-first: queue [2, 3, 1, 0]
    assert m.gpu_pool.free_block_queue.block_ids() == [2, 3, 1, 0]
    assert m.allocate_slots(2, B[:8], 8) == Allocation([2, 3], [])
    assert m.stats().evictions == 0
    assert m.allocate_slots(3, [9] * 4, 4) == Allocation([1], [])  # evicts A's second block
    assert m.stats().evictions == 1
    assert m.lookup_prefix(A[:9]) == [0]
    m.check_invariants()


def test_free_is_tail_first_so_shared_prefix_is_evicted_last():
    m = mgr(gpu=3)
    m.allocate_slots(1, A, 12)
    m.free(1)
    assert m.gpu_pool.free_block_queue.block_ids() == [2, 1, 0]
    assert m.allocate_slots(2, B[:4], 4) == Allocation([2], [])
    assert m.lookup_prefix(A) == [0, 1]


def test_same_tokens_filled_twice_share_one_hash_in_the_map():
    m = mgr()
    m.allocate_slots(1, A[:4], 4)
    m.allocate_slots(2, A[:4], 4)
    h = m.gpu_pool.blocks[0].block_hash
    assert m.gpu_pool.cached_block_hash_to_block[h] == {0: m.gpu_pool.blocks[0], 1: m.gpu_pool.blocks[1]}
    m.free(1)
    m.check_invariants()
    assert m.lookup_prefix(A[:5]) in ([0], [1])


def test_refuses_without_changing_anything_when_blocks_run_out():
    m = mgr(gpu=4)
    m.allocate_slots(1, A, 12)
    before = m.stats()
    assert m.allocate_slots(2, B[:8], 8) is None
    assert not m.has_seq(2) and m.num_slots(2) == 0
    assert m.allocate_slots(1, A + B[:5], 5) is None
    assert m.num_slots(1) == 12 and m.block_table(1) == [0, 1, 2]
    assert m.stats() == before
    m.check_invariants()


def test_admission_keeps_the_watermark_free():
    m = mgr(gpu=100, watermark=0.05)  # 5 blocks held back
    tokens = list(range(400))
    assert m.allocate_new(1, tokens[:384], 384, admit=True) is None  # 96 blocks, 4 left
    assert m.allocate_new(1, tokens[:380], 380, admit=True) == Allocation(list(range(95)), [])
    assert m.allocate_slots(1, tokens[:400], 20) is not None  # running seqs may use the watermark
    assert m.num_free_gpu_blocks == 0


def test_fork_shares_blocks_and_copies_on_write():
    m = mgr()
    m.allocate_slots(1, A[:6], 6)
    m.fork(1, 2)
    assert m.block_table(2) == [0, 1] and m.gpu_pool.blocks[1].ref_cnt == 2
    m.check_invariants()
    child = A[:6] + [50, 51, 52]
    assert m.allocate_slots(2, child, 3) == Allocation([3], [(1, 2)])
    assert m.block_table(2) == [0, 2, 3] and m.block_table(1) == [0, 1]
    assert m.allocate_slots(1, A[:7], 1) == Allocation([], [])  # block 1 is no longer shared
    m.check_invariants()
    m.free(1)
    m.free(2)
    assert m.num_free_gpu_blocks == 8
    m.check_invariants()


def test_full_shared_block_needs_no_copy():
    m = mgr()
    m.allocate_slots(1, A[:8], 8)
    m.fork(1, 2)
    assert m.allocate_slots(2, A[:8] + [1], 1) == Allocation([2], [])
    assert m.block_table(2) == [0, 1, 2]
    m.check_invariants()


def test_swap_out_and_in_keeps_group_sharing():
    m = mgr(gpu=8, cpu=4)
    m.allocate_slots(1, A[:6], 6)
    m.fork(1, 2)
    assert m.can_swap_out([1, 2])
    assert m.swap_out([1, 2]) == [(0, 0), (1, 1)]
    assert m.is_swapped(1) and m.is_swapped(2)
    assert m.block_table(1) == [0, 1] and m.block_table(2) == [0, 1]
    assert m.num_free_gpu_blocks == 8 and m.num_free_cpu_blocks == 2
    assert m.cpu_pool.blocks[0].ref_cnt == 2
    m.check_invariants()
    # freed tail-first: clean partial block 1 to the head, cached block 0 to the tail
    assert m.gpu_pool.free_block_queue.block_ids() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert m.can_swap_in([1, 2])
    assert m.swap_in([1, 2]) == [(0, 1), (1, 2)]
    assert m.block_table(1) == [1, 2] and m.block_table(2) == [1, 2]
    assert m.gpu_pool.blocks[2].ref_cnt == 2 and m.num_free_cpu_blocks == 4
    m.check_invariants()
    assert m.allocate_slots(2, A[:7], 1) == Allocation([], [(2, 3)])
    m.check_invariants()


def test_swap_checks_capacity_and_state():
    m = mgr(gpu=8, cpu=2, watermark=0.0)
    m.allocate_slots(1, A, 12)
    assert not m.can_swap_out([1])
    with pytest.raises(ValueError, match="swap_out needs 3 blocks, only 2 CPU swap space"):
        m.swap_out([1])
    m.allocate_slots(2, B[:8], 8)
    m.swap_out([2])
    with pytest.raises(ValueError, match="seq 2 is already swapped out"):
        m.swap_out([2])
    with pytest.raises(ValueError, match="seq 1 is not swapped out"):
        m.swap_in([1])
    with pytest.raises(ValueError, match="swap_in before allocating"):
        m.allocate_slots(2, B[:9], 1)
    m.allocate_slots(3, list(range(12)), 12)
    assert m.num_free_gpu_blocks == 2
    assert m.can_swap_in([2])
    m.allocate_slots(4, [7] * 4, 4)
    assert not m.can_swap_in([2])
    m.free(2)  # freeing a swapped seq releases its CPU blocks
    assert m.num_free_cpu_blocks == 2
    m.check_invariants()


def test_swap_in_respects_watermark():
    m = mgr(gpu=10, cpu=4, watermark=0.2)  # 2 blocks held back
    m.allocate_slots(1, A[:8], 8)
    m.swap_out([1])
    m.allocate_slots(2, list(range(24)), 24)  # 6 blocks, 4 free
    assert m.can_swap_in([1])
    m.allocate_slots(3, [5], 1)
    assert not m.can_swap_in([1])


def test_swapped_in_full_blocks_are_cached_again():
    m = mgr(gpu=4, cpu=4)
    m.allocate_slots(1, A[:8], 8)
    m.swap_out([1])
    m.allocate_slots(2, list(range(16)), 16)  # evicts both of A's cached blocks
    assert m.stats().evictions == 2
    m.free(2)
    assert m.gpu_pool.free_block_queue.block_ids() == [0, 1, 3, 2]
    assert m.swap_in([1]) == [(0, 0), (1, 1)]
    assert m.stats().evictions == 4
    assert m.lookup_prefix(A[:9]) == [0, 1]
    m.check_invariants()


def test_stale_prefix_is_rejected():
    m = mgr(gpu=3)
    m.allocate_slots(1, A[:8], 8)
    m.free(1)
    prefix = m.lookup_prefix(A[:9])
    assert prefix == [0, 1]
    m.allocate_slots(2, B, 12)  # evicts both
    m.free(2)
    with pytest.raises(ValueError, match="no longer holds this prompt's KV"):
        m.allocate_new(3, A[:9], 1, prefix)


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="block_size must be > 0"):
        mgr(bs=0)
    with pytest.raises(ValueError, match="watermark"):
        mgr(watermark=1.5)
    m = mgr()
    with pytest.raises(ValueError, match="exceeds the 3 known token ids"):
        m.allocate_slots(1, A[:3], 3) and m.allocate_slots(1, A[:3], 1)
    with pytest.raises(ValueError, match="cannot fork unknown seq 9"):
        m.fork(9, 10)
    with pytest.raises(ValueError, match="already exists"):
        m.fork(1, 1)
    with pytest.raises(ValueError, match="unknown seq 5"):
        m.block_table(5)
    m.free(5)  # unknown id: no-op


def test_invariant_checker_catches_a_wrong_ref_count():
    m = mgr()
    m.allocate_slots(1, A, 12)
    m.gpu_pool.blocks[1].ref_cnt = 2
    with pytest.raises(AssertionError, match="GPU block 1: ref_cnt 2, held by 1 tables"):
        m.check_invariants()


def test_stats_report_usage_fractions():
    m = mgr(gpu=8, cpu=4)
    m.allocate_slots(1, A, 12)
    m.allocate_slots(2, B[:4], 4)
    m.swap_out([2])
    s = m.stats()
    assert (s.num_free_gpu_blocks, s.num_free_cpu_blocks) == (5, 3)
    assert (s.gpu_usage, s.cpu_usage) == (3 / 8, 1 / 4)


def test_nothing_new_allocation_is_shared_and_read_only():
    m = mgr()
    m.allocate_slots(1, A[:2], 2)
    alloc = m.allocate_slots(1, A[:3], 1)
    assert alloc == Allocation([], [])
    with pytest.raises(TypeError, match="read-only"):
        alloc.new_block_ids.append(3)
    assert m.allocate_slots(1, A[:4], 1).new_block_ids == []
