"""Giving back a sequence's trailing slots: speculative decoding's rejected proposals.

The scheduler reserves slots for a verify row's proposed tokens through the one grow API
(`KVCacheManager.allocate_slots`, the proposals counted as pending tokens, so no block they
fill is hashed), and once the result says how many were accepted it gives the rest back here.
Invariants kept: a block that only rejected tokens filled goes back to the free queue (it was
never hashed: only known tokens enter the prefix cache); the table, num_slots and tail_room
describe the kept slots exactly as if they had been reserved alone.
"""

from __future__ import annotations

from kvcache.block_pool import BlockPool
from kvcache.tables import SeqBlocks


def rollback_slots(seq: SeqBlocks, pool: BlockPool, block_size: int, num_slots: int) -> int:
    """Shrink `seq` (on the GPU) to its first num_slots slots, freeing blocks left empty;
    returns how many were freed (the workers' copy of the table must then shrink too)."""
    if seq.swapped:
        raise ValueError("a swapped-out sequence has no slots to give back")
    if not 0 < num_slots <= seq.num_slots:
        raise ValueError(f"cannot roll {seq.num_slots} slots back to {num_slots}")
    if len(seq.block_hashes) * block_size > num_slots:
        raise ValueError(f"slots {num_slots}.. lie in a hashed block: only pending slots "
                         "(proposals) can be given back")
    keep = -(-num_slots // block_size)
    table = seq.block_ids
    freed = len(table) - keep
    if freed:
        blocks = pool.blocks
        pool.free_blocks(blocks[b] for b in reversed(table[keep:]))
        del table[keep:]
    seq.num_slots = num_slots
    seq.tail_room = keep * block_size - num_slots
    return freed
