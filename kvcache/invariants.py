"""The consistency check of a KVCacheManager: block pools, ref counts, tables, hash chains.

Tests and debugging call it (`KVCacheManager.check_invariants`); no step does, so its cost
(O(blocks + table entries)) never reaches the hot path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcache.manager import KVCacheManager


def check_manager_invariants(kv: KVCacheManager) -> None:
    """KVCacheManager.check_invariants: raise AssertionError naming the first violation."""
    kv.gpu_pool.check_invariants()
    kv.cpu_pool.check_invariants()
    if kv.tier is not None:
        kv.tier.check_invariants()
    bs = kv.block_size
    refs = {False: [0] * kv.num_gpu_blocks, True: [0] * kv.num_cpu_blocks}
    for sid, seq in kv._seqs.items():
        if len(seq.block_ids) != -(-seq.num_slots // bs):
            raise AssertionError(
                f"seq {sid}: {len(seq.block_ids)} blocks for {seq.num_slots} slots"
            )
        if seq.tail_room != len(seq.block_ids) * bs - seq.num_slots:
            raise AssertionError(
                f"seq {sid}: tail_room {seq.tail_room} but {len(seq.block_ids)} blocks hold "
                f"{seq.num_slots} slots"
            )
        counts = refs[seq.swapped]
        for b in seq.block_ids:
            if not 0 <= b < len(counts):
                raise AssertionError(f"seq {sid} holds out-of-range block id {b}")
            counts[b] += 1
        pool = kv.cpu_pool if seq.swapped else kv.gpu_pool
        if (
            seq.num_slots % bs
            and not seq.shared_tail
            and pool.blocks[seq.block_ids[-1]].ref_cnt > 1
        ):
            raise AssertionError(
                f"seq {sid}: partially filled last block {seq.block_ids[-1]} is shared but "
                "shared_tail is False (a decode step would skip copy-on-write)"
            )
        if kv.enable_prefix_caching:
            # The last full block may wait for its hash (filled ahead of its token).
            if not 0 <= seq.num_slots // bs - len(seq.block_hashes) <= 1:
                raise AssertionError(
                    f"seq {sid}: {len(seq.block_hashes)} block hashes for "
                    f"{seq.num_slots // bs} full blocks"
                )
            if not seq.swapped:
                for i, h in enumerate(seq.block_hashes):
                    if kv.gpu_pool.blocks[seq.block_ids[i]].block_hash != h:
                        raise AssertionError(
                            f"seq {sid}: full block {seq.block_ids[i]} (position {i}) "
                            "does not carry the seq's chained hash"
                        )
    for swapped, pool in ((False, kv.gpu_pool), (True, kv.cpu_pool)):
        name = "CPU" if swapped else "GPU"
        referenced = 0
        for block, count in zip(pool.blocks, refs[swapped]):
            if block.ref_cnt != count:
                raise AssertionError(
                    f"{name} block {block.block_id}: ref_cnt {block.ref_cnt}, held by {count} tables"
                )
            referenced += count > 0
        if referenced + pool.num_free_blocks != pool.num_blocks:
            raise AssertionError(
                f"{name}: {referenced} referenced + {pool.num_free_blocks} free != {pool.num_blocks}"
            )
