import random

import pytest

from kvcache import KVCacheManager, prompt_block_hashes
from kvcache.events import CLEARED, DEVICE, EVICTED, STORED, KVEventLog


def follow(held: set[bytes], entries) -> None:
    for _, op, medium, hashes in entries:
        if medium != DEVICE:
            assert op == CLEARED  # a snapshot clears every medium; only the device one is used
            continue
        if op == STORED:
            held.update(hashes)
        elif op == EVICTED:
            held.difference_update(hashes)
        else:
            held.clear()


def test_following_the_log_reproduces_the_cache_map_through_evictions_and_reset():
    rng = random.Random(0)
    m = KVCacheManager(num_gpu_blocks=12, num_cpu_blocks=0, block_size=4)
    held: set[bytes] = set()
    cursor = (None, 0)
    live: list[int] = []
    for step in range(300):
        if live and (rng.random() < 0.45 or m.num_free_gpu_blocks < 4):
            m.free(live.pop(rng.randrange(len(live))))
        else:
            prefix = [rng.randrange(3)] * 4  # a few shared first blocks
            tokens = prefix + [rng.randrange(50) for _ in range(rng.randrange(4, 9))]
            hit = m.lookup_prefix(tokens)
            if m.num_blocks_needed(step, len(tokens), hit) <= m.num_free_gpu_blocks:
                m.allocate_new(step, tokens, len(tokens) - 4 * len(hit), hit)
                live.append(step)
        if step == 150:
            m.reset()
            live.clear()
        if step % 7 == 0:
            batch = m.events.since(*cursor)
            follow(held, batch.entries)
            cursor = (batch.epoch, batch.seq)
            assert held == set(m.gpu_pool.cached_block_hash_to_block), step
    assert m.gpu_pool.num_evictions > 10  # the walk did evict, so EVICTED was exercised


def test_evicted_only_when_the_last_block_with_the_hash_goes():
    m = KVCacheManager(num_gpu_blocks=4, num_cpu_blocks=0, block_size=2)
    m.events.since(None, 0)  # a follower: from now on the pool reports
    m.allocate_slots(1, [7, 7], 2)
    m.allocate_slots(2, [7, 7], 2)  # the same hash filled independently: two blocks, one key
    start = m.events.seq
    m.free(1)
    m.free(2)
    m.allocate_slots(3, [1, 2, 3, 4, 5, 6], 6)  # two clean blocks, then one of the [7, 7]s
    (h77,) = prompt_block_hashes([7, 7], 2)
    ops = [op for _, op, _, _ in m.events.since(m.events.epoch, start).entries]
    assert ops == [STORED]  # [7, 7] is still held by the other block
    m.free(3)
    start = m.events.seq
    m.allocate_slots(4, [9] * 8, 8)  # every block: the last [7, 7] goes
    ops = [(op, h) for _, op, _, h in m.events.since(m.events.epoch, start).entries]
    assert (EVICTED, (h77,)) in ops and ops[-1][0] == STORED


def test_a_follower_behind_the_trimmed_log_or_from_another_epoch_gets_a_snapshot():
    held_now = {DEVICE: [b"a" * 16, b"b" * 16]}
    log = KVEventLog(lambda: held_now, capacity=2)
    for h in (b"x" * 16, b"y" * 16, b"z" * 16):
        log.evicted(DEVICE, h)
    assert log.since(log.epoch, 1).entries == [(2, EVICTED, DEVICE, (b"y" * 16,)),
                                                (3, EVICTED, DEVICE, (b"z" * 16,))]
    assert not log.since(log.epoch, 1).snapshot
    assert log.since(log.epoch, 3).entries == []
    for cursor in [(log.epoch, 0), ("another", 3), (None, 0), (log.epoch, 9)]:
        batch = log.since(*cursor)
        assert batch.snapshot and batch.seq == 3
        assert [(op, medium) for _, op, medium, _ in batch.entries] == [
            (CLEARED, "device"), (CLEARED, "cpu"), (STORED, "device")]
        assert batch.entries[-1][3] == (b"a" * 16, b"b" * 16)


def test_nothing_is_recorded_until_someone_follows():
    m = KVCacheManager(num_gpu_blocks=4, num_cpu_blocks=0, block_size=2)
    m.allocate_slots(1, [1, 2, 3, 4], 4)
    m.reset()
    assert m.gpu_pool.events is None and m.events.seq == 0
    m.allocate_slots(1, [1, 2, 3, 4], 4)
    first = m.events.since(None, 0)  # a snapshot of what is held now
    assert first.snapshot and len(first.entries[-1][3]) == 2
    assert m.gpu_pool.events is m.events
    m.reset()  # a reset keeps reporting into the followed log
    assert m.gpu_pool.events is m.events
    after = m.events.since(first.epoch, first.seq).entries  # both tiers were emptied
    assert [(op, medium) for _, op, medium, _ in after] == [(CLEARED, "device"), (CLEARED, "cpu")]


def test_log_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        KVEventLog(capacity=0)


def test_offload_tier_reports_its_hashes_as_cpu():
    # Blocks of 2 tokens, 2 GPU blocks: the second prompt evicts the first one's full block
    # into the tier, which a follower then sees as held on the CPU, not on the device.
    m = KVCacheManager(num_gpu_blocks=2, num_cpu_blocks=0, block_size=2, num_offload_blocks=4)
    start = m.events.since(None, 0)
    m.allocate_slots(1, [1, 2, 3], 3)
    m.free(1)
    m.allocate_slots(2, [5, 6, 7, 8], 4)
    m.take_transfers()
    ops = [(op, medium) for _, op, medium, _ in m.events.since(start.epoch, start.seq).entries]
    assert (STORED, "cpu") in ops and (EVICTED, "device") in ops
    held = m.events.since(None, 0)  # a snapshot names both tiers
    media = {medium for _, op, medium, hashes in held.entries if op == STORED and hashes}
    assert media == {"device", "cpu"}
