"""The shortcuts taken for speed (batched hashing and map updates, hashes computed once on
arrival, allocate_slots' decode fast path) give exactly the results of the step-by-step
definitions."""

import random

import pytest

from kvcache import Allocation, BlockPool, KVCacheManager, hash_block_tokens
from kvcache.hashing import prompt_block_hashes

A = list(range(100, 112))  # three blocks of 4
B = list(range(200, 212))
H, X, Y = b"h" * 16, b"x" * 16, b"y" * 16


def mgr(gpu: int = 8, cpu: int = 4, bs: int = 4, **kw) -> KVCacheManager:
    return KVCacheManager(num_gpu_blocks=gpu, num_cpu_blocks=cpu, block_size=bs, **kw)


def chain(tokens: list[int], bs: int, extra: bytes | None = None) -> list[bytes]:
    out, h = [], None
    for i in range(len(tokens) // bs):
        h = hash_block_tokens(h, tokens[i * bs : (i + 1) * bs], extra)
        out.append(h)
    return out


def test_get_new_blocks_evicts_before_caching_the_new_hashes():
    pool = BlockPool(3)
    (b0,) = pool.get_new_blocks(1, [H])
    pool.free_blocks([b0])
    assert pool.free_block_queue.block_ids() == [1, 2, 0]
    got = pool.get_new_blocks(3, [H, X, Y])  # block 0 leaves H, block 1 takes it
    assert [b.block_id for b in got] == [1, 2, 0]
    blocks = pool.blocks
    assert pool.cached_block_hash_to_block == {H: blocks[1], X: blocks[2], Y: blocks[0]}
    assert pool.num_evictions == 1 and [b.ref_cnt for b in blocks] == [1, 1, 1]
    pool.check_invariants()


def test_get_new_blocks_with_a_repeated_hash_builds_a_shared_entry():
    pool = BlockPool(4)
    got = pool.get_new_blocks(3, [H, H])
    assert [b.block_hash for b in got] == [H, H, None]
    assert pool.cached_block_hash_to_block == {H: {0: got[0], 1: got[1]}}
    pool.check_invariants()
    with pytest.raises(ValueError, match="2 hashes for 1 new blocks"):
        pool.get_new_blocks(1, [X, Y])


def test_get_new_block_takes_the_head_and_evicts():
    pool = BlockPool(2)
    (b0,) = pool.get_new_blocks(1, [H])
    pool.free_blocks([b0])
    assert pool.get_new_block().block_id == 1
    assert pool.get_new_block() is b0 and b0.block_hash is None and b0.ref_cnt == 1
    assert pool.cached_block_hash_to_block == {} and pool.num_evictions == 1
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_block()
    pool.check_invariants()


def test_prompt_partly_cached_by_a_running_seq_shares_the_entries():
    m = mgr()
    m.allocate_slots(1, A, 12)
    prompt = A[:8] + B[:5]  # no lookup: blocks 0-1 are filled a second time
    assert m.allocate_slots(2, prompt, 13) == Allocation([3, 4, 5, 6], [])
    cache, blocks = m.gpu_pool.cached_block_hash_to_block, m.gpu_pool.blocks
    h = chain(prompt, 4)
    assert cache[h[0]] == {0: blocks[0], 3: blocks[3]} and cache[h[1]] == {1: blocks[1], 4: blocks[4]}
    assert cache[h[2]] is blocks[5]
    assert m.lookup_prefix(prompt + [9]) == [0, 1, 5]  # a shared entry answers with its first block
    m.check_invariants()


def test_chunked_prefill_hashes_every_block_it_fills():
    m = mgr()
    assert m.allocate_slots(1, A, 2) == Allocation([0], [])
    assert m.allocate_slots(1, A, 10) == Allocation([1, 2], [])
    assert [m.gpu_pool.blocks[b].block_hash for b in (0, 1, 2)] == chain(A, 4)
    assert m.lookup_prefix(A + [1]) == [0, 1, 2]
    m.check_invariants()


def test_prefix_blocks_evicted_between_lookup_and_allocate_are_refused():
    m = mgr(gpu=4)
    m.allocate_slots(2, B[:8], 8)
    m.allocate_slots(1, A[:8], 8)
    m.free(1)
    prefix = m.lookup_prefix(A[:9])
    assert prefix == [2, 3]
    assert m.allocate_slots(2, B[:9], 1) == Allocation([3], [])  # evicts block 3
    with pytest.raises(ValueError, match=r"prefix block 3 \(position 1\) no longer holds"):
        m.allocate_new(3, A[:9], 1, prefix)
    m.check_invariants()


def test_allocate_accepts_a_shortened_prefix_and_other_sequence_types():
    m = mgr()
    m.allocate_slots(1, A, 12)
    m.free(1)
    prefix = m.lookup_prefix(tuple(A) + (7,))
    assert prefix == [0, 1, 2]
    assert m.allocate_new(2, tuple(A) + (7,), 9, tuple(prefix[:1])) == Allocation([3, 4, 5], [])
    assert m.block_table(2) == [0, 3, 4, 5] and m.num_slots(2) == 13
    s = m.stats()
    assert (s.prefix_queries, s.prefix_hits) == (25, 4)
    m.check_invariants()


def test_prefix_from_other_tokens_is_refused():
    m = mgr()
    m.allocate_slots(1, A, 12)
    m.free(1)
    prefix = m.lookup_prefix(A + [7])
    other = A[:4] + B[:8] + [7]
    with pytest.raises(ValueError, match=r"prefix block 1 \(position 1\) no longer holds"):
        m.allocate_new(2, other, 1, prefix)
    assert m.allocate_new(2, other, 9, prefix[:1]) == Allocation([3, 4, 5], [])
    assert [m.gpu_pool.blocks[b].block_hash for b in (0, 3, 4)] == chain(other, 4)
    m.check_invariants()


def test_prompt_block_hashes_are_the_block_by_block_chain():
    assert prompt_block_hashes(A + [7], 4) == chain(A, 4)
    assert prompt_block_hashes(A, 4, b"salt") == chain(A, 4, b"salt")
    assert prompt_block_hashes(A[:3], 4) == []


def test_given_block_hashes_give_the_same_lookup_and_tables():
    def run(with_hashes: bool) -> tuple:
        m = mgr(gpu=12)
        prompt = A + B[:5]
        given = prompt_block_hashes(prompt, 4) if with_hashes else None
        m.allocate_new(1, A, 12, block_hashes=given[:3] if given else ())
        m.free(1)
        prefix = m.lookup_prefix(prompt, None, given)
        alloc = m.allocate_new(2, prompt, len(prompt) - 4 * len(prefix), prefix,
                                 block_hashes=given or ())
        m.check_invariants()
        return prefix, alloc, m.block_table(2), [m.gpu_pool.blocks[b].block_hash for b in m.block_table(2)]

    assert run(True) == run(False)
    prefix, alloc, table, hashes = run(True)
    assert (prefix, alloc, table) == ([0, 1, 2], Allocation([3, 4], []), [0, 1, 2, 3, 4])
    assert hashes == chain(A + B[:5], 4) + [None]


def test_given_hashes_are_trusted_for_every_chunk_they_cover():
    # Hashes given on arrival name the blocks as later prefill chunks fill them, unhashed:
    # proven here with made-up names, which only a caller breaking the contract would pass.
    names = [H, X, Y]
    m = mgr()
    assert m.allocate_new(1, A, 2, block_hashes=names) == Allocation([0], [])
    assert m.allocate_slots(1, A, 5) == Allocation([1], [])  # fills block 0 only
    assert m.allocate_slots(1, A, 5) == Allocation([2], [])  # fills blocks 1 and 2
    assert [m.gpu_pool.blocks[b].block_hash for b in (0, 1, 2)] == names
    assert m.lookup_prefix(A + [7], None, names) == [0, 1, 2]
    m.allocate_slots(1, A + [5, 6, 7, 8], 4)  # past the given hashes: hashed from the tokens
    assert m.gpu_pool.blocks[m.block_table(1)[3]].block_hash == hash_block_tokens(Y, [5, 6, 7, 8])
    m.check_invariants()


def test_allocate_takes_the_lookups_blocks_unchecked_only_while_nothing_was_evicted(monkeypatch):
    m = mgr(gpu=5)
    m.allocate_slots(1, A, 12)
    m.free(1)  # blocks 0-2 cached and free
    prompt = A + [7]
    given = prompt_block_hashes(prompt, 4)
    prefix = m.lookup_prefix(prompt, None, given)
    assert prefix == [0, 1, 2]

    def no_check(*args):
        raise AssertionError("the prefix was checked block by block")

    with monkeypatch.context() as mp:
        mp.setattr(m.prefix, "check", no_check)
        assert m.allocate_new(2, prompt, 5, prefix[:2], block_hashes=given) == Allocation([3, 4], [])
    assert m.block_table(2) == [0, 1, 3, 4] and m.gpu_pool.blocks[2].ref_cnt == 0
    m.check_invariants()
    # The same hashes object, but an eviction since the lookup: the blocks are checked again.
    m = mgr(gpu=4)
    m.allocate_slots(1, A, 12)
    m.free(1)  # free queue: 3 (clean), then cached 2, 1, 0
    prefix = m.lookup_prefix(prompt, None, given)
    assert prefix == [0, 1, 2]
    assert m.allocate_slots(3, B[:8], 8) == Allocation([3, 2], [])  # evicts block 2's hash
    with pytest.raises(ValueError, match=r"prefix block 2 \(position 2\) no longer holds"):
        m.allocate_new(5, prompt, 1, prefix, block_hashes=given)
    m.check_invariants()


def test_allocate_checks_a_prefix_looked_up_under_other_hashes():
    m = mgr()
    m.allocate_slots(1, A, 12)
    m.free(1)
    prefix = m.lookup_prefix(A + [7], None, prompt_block_hashes(A + [7], 4))
    other = A[:4] + B[:8] + [7]
    with pytest.raises(ValueError, match=r"prefix block 1 \(position 1\) no longer holds"):
        m.allocate_new(2, other, 1, prefix, block_hashes=prompt_block_hashes(other, 4))
    m.check_invariants()


def test_decode_in_a_formerly_shared_block_writes_in_place():
    m = mgr()
    m.allocate_slots(1, A[:6], 6)
    m.fork(1, 2)
    m.free(2)
    assert m.allocate_slots(1, A[:7], 1) == Allocation([], [])  # the sibling is gone: no copy
    m.fork(1, 3)
    assert m.allocate_slots(3, A[:7] + [9], 1) == Allocation([], [(1, 2)])
    assert m.block_table(3) == [0, 2]
    assert m.allocate_slots(1, A[:8], 1) == Allocation([], [])
    m.check_invariants()


def test_random_long_prompts_match_the_block_by_block_chain():
    rng = random.Random(0)
    bs = 16
    m = mgr(gpu=512, bs=bs)
    for sid, n in enumerate((1000, 1024, 1025, 17, 16, 15)):
        prompt = [rng.randrange(0, 1 << 31) for _ in range(n)]
        for extra in (None, b"salt"):
            prefix = m.lookup_prefix(prompt, extra)
            assert prefix == []
            assert m.allocate_new(2 * sid + (extra is not None), prompt, n, prefix, extra) is not None
            blocks = m.block_table(2 * sid + (extra is not None))
            assert [m.gpu_pool.blocks[b].block_hash for b in blocks[: n // bs]] == chain(prompt, bs, extra)
            again = m.lookup_prefix(prompt + [5], extra)
            assert again == blocks[: n // bs]
        m.check_invariants()


def test_token_ids_outside_int32_are_a_value_error_by_allocation_at_the_latest():
    m = mgr()
    bad = A[:4] + [1 << 40] + A[5:9]
    assert m.lookup_prefix(bad) == []  # block 0 misses: the prompt is hashed by allocate_slots
    with pytest.raises(ValueError, match="token ids must fit in int32"):
        m.allocate_slots(1, bad, 9)
    assert not m.has_seq(1) and m.num_free_gpu_blocks == 8
    with pytest.raises(ValueError, match="token ids must fit in int32"):
        m.lookup_prefix([1 << 40] + A)
    m.allocate_slots(2, A[:4], 4)
    with pytest.raises(ValueError, match="token ids must fit in int32"):
        m.lookup_prefix(bad)  # block 0 hits: the whole prompt is hashed here
    m.check_invariants()


def _state(m: KVCacheManager, sids: list[int]) -> list:
    blocks = m.gpu_pool.blocks
    return [(m.block_table(s), m.num_slots(s), m.is_swapped(s)) for s in sids if m.has_seq(s)] + [
        [(b.ref_cnt, b.block_hash) for b in blocks], m.num_free_gpu_blocks, m.stats()]


def _general(m: KVCacheManager, sid: int, tokens: list[int], num_pending: int = 0):
    """allocate_slots(sid, tokens, 1) by the general path only (no decode fast path)."""
    seq = m._seqs.get(sid)
    if seq is None:
        return m.allocate_slots(sid, tokens, 1)
    return m._grow(sid, seq, tokens, 1, num_pending)


@pytest.mark.parametrize("seed", range(4))
def test_decode_fast_path_matches_the_general_path(seed: int):
    """Random decode steps, forks (copy-on-write), frees, swaps and refusals: allocate_slots'
    one-token fast path and its general path give equal results and leave equal managers."""
    rng = random.Random(seed)
    slow, fast = mgr(gpu=24, cpu=16), mgr(gpu=24, cpu=16)
    toks: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(400):
        op = rng.random()
        sids = sorted(toks)
        if op < 0.1 or not sids:
            toks[next_id] = [rng.randrange(0, 9) for _ in range(rng.randint(1, 9))]
            n = len(toks[next_id])
            assert slow.allocate_slots(next_id, toks[next_id], n) == fast.allocate_slots(
                next_id, toks[next_id], n)
            if not slow.has_seq(next_id):
                del toks[next_id]
            next_id += 1
        elif op < 0.15 and not slow.is_swapped(sids[0]):
            parent = rng.choice([s for s in sids if not slow.is_swapped(s)])
            slow.fork(parent, next_id)
            fast.fork(parent, next_id)
            toks[next_id] = list(toks[parent])
            next_id += 1
        elif op < 0.2:
            sid = rng.choice(sids)
            slow.free(sid)
            fast.free(sid)
            del toks[sid]
        elif op < 0.25:
            sid = rng.choice(sids)
            if slow.is_swapped(sid):
                if slow.can_swap_in([sid]):
                    assert slow.swap_in([sid]) == fast.swap_in([sid])
            elif slow.can_swap_out([sid]):
                assert slow.swap_out([sid]) == fast.swap_out([sid])
        else:
            sid = rng.choice(sids)
            t = toks[sid]
            if slow.num_slots(sid) == len(t):
                t.append(rng.randrange(0, 9))  # the sampled token arrives
            if slow.is_swapped(sid):
                for m in (slow, fast):
                    with pytest.raises(ValueError, match="swapped out"):
                        m.allocate_slots(sid, t, 1) if m is fast else _general(m, sid, t)
                continue
            assert fast.allocate_slots(sid, t, 1) == _general(slow, sid, t)
        assert _state(slow, sorted(toks)) == _state(fast, sorted(toks))
    fast.check_invariants()


def test_one_slot_errors_and_new_seq():
    m = mgr()
    assert m.allocate_slots(1, A[:3], 1) == Allocation([0], [])  # unknown seq: a new one, 1 slot
    assert m.num_slots(1) == 1
    assert m.allocate_slots(1, A[:3], 1) == Allocation([], [])
    assert m.allocate_slots(1, A[:3], 1) == Allocation([], [])
    with pytest.raises(ValueError, match="exceeds the 3 known token ids"):
        m.allocate_slots(1, A[:3], 1)
    assert m.num_slots(1) == 3
    assert m.allocate_slots(1, A[:4], 1) == Allocation([], [])  # fills block 0: hashed and cached
    assert m.gpu_pool.blocks[0].block_hash == chain(A[:4], 4)[0]
    m.check_invariants()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("pending", [0, 1])
def test_allocate_decode_slots_is_allocate_slots_for_each_sequence(seed: int, pending: int):
    """A decode batch in one allocate_decode_slots call leaves the manager as the general path
    of allocate_slots(seq, tokens, 1) called for each sequence in order: same tables, hashes,
    free queue and new block ids, over many steps across block boundaries (with pending
    tokens, each block is hashed a step late)."""
    rng = random.Random(seed)
    one, bulk = mgr(gpu=64, cpu=0), mgr(gpu=64, cpu=0)
    toks = {sid: [rng.randrange(0, 5) for _ in range(rng.randint(1, 9))] for sid in range(6)}
    for m in (one, bulk):
        for sid, t in toks.items():
            m.allocate_slots(sid, t, len(t) - 1)  # the last token is the next decode's input
    sids = sorted(toks)
    for _ in range(12):
        expected = {}
        for sid in sids:
            alloc = _general(one, sid, toks[sid], pending)
            if alloc.new_block_ids:
                expected[sid] = alloc.new_block_ids
        opened: dict[int, list[int]] = {}
        assert bulk.allocate_decode_slots(sids, [toks[s] for s in sids], pending, opened) == len(sids)
        assert opened == expected
        assert _state(one, sids) == _state(bulk, sids)
        for t in toks.values():
            t.append(rng.randrange(0, 5))  # each step's sampled token
    bulk.check_invariants()
    if not pending:
        assert all(len(bulk._seqs[s].block_hashes) == bulk.num_slots(s) // 4 for s in sids)


def test_allocate_decode_slots_stops_untouched_at_a_shared_tail_an_unknown_seq_or_a_full_pool():
    m = mgr(gpu=5, cpu=0)
    m.allocate_slots(1, A[:4], 4)  # block 0 full
    m.allocate_slots(2, B[:3], 2)  # block 1, room 2
    m.fork(2, 3)  # 3 shares block 1
    before = _state(m, [1, 2, 3])
    opened: dict[int, list[int]] = {}
    assert m.allocate_decode_slots([2, 1], [B[:3], A[:5]], 0, opened) == 0  # 2's tail is shared
    assert m.allocate_decode_slots([1, 9], [A[:5], A[:2]], 0, opened) == 1  # seq 9 is unknown
    assert opened == {1: [2]} and m.num_slots(1) == 5
    assert _state(m, [2, 3])[:2] == before[1:3]  # their tables and slots
    m.allocate_slots(4, B, 8)  # takes the last two free blocks
    assert m.num_free_gpu_blocks == 0
    t1 = A[:5] + [0, 0, 0, 0]
    for _ in range(3):
        assert m.allocate_decode_slots([1], [t1], 0, opened) == 1  # room in block 2
    assert m.allocate_decode_slots([1], [t1], 0, {}) == 0  # block 2 is full and none is free
    assert m.num_slots(1) == 8
    assert m.allocate_slots(1, t1, 1) is None  # the general path refuses too, changing nothing
    m.check_invariants()


def test_decode_slot_at_a_shared_tail_copies():
    m = mgr(gpu=5, cpu=0)
    m.allocate_slots(2, B[:3], 2)  # block 0, room 2
    m.fork(2, 3)  # 3 shares block 0
    assert m.allocate_slots(2, B[:3], 1) == Allocation([], [(0, 1)])  # 2's tail is shared
    assert m.block_table(2) == [1] and m.block_table(3) == [0]
    m.check_invariants()
