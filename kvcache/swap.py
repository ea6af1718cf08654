"""Swapping groups of sequences between the GPU and CPU block pools.

A group (a request's live sequences) moves together so blocks shared by its sequences (after
a fork) move once and stay shared: each side's mapping lists every distinct block once.
Swapped in, a sequence's full blocks re-enter the prefix cache under the hashes it kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.block_pool import BlockPool, KVCacheBlock
from kvcache.tables import SeqBlocks


def group(seqs: dict[int, SeqBlocks], seq_ids: Sequence[int], swapped: bool) -> list[SeqBlocks]:
    """The tables of seq_ids, each of which must be swapped out (or not) as `swapped` says."""
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"duplicate seq ids in swap group {list(seq_ids)}")
    out = []
    for sid in seq_ids:
        seq = seqs.get(sid)
        if seq is None:
            raise ValueError(f"unknown seq {sid} in swap group")
        if seq.swapped != swapped:
            state = "already swapped out" if seq.swapped else "not swapped out"
            raise ValueError(f"seq {sid} is {state}")
        out.append(seq)
    return out


def distinct_blocks(seqs: list[SeqBlocks]) -> list[int]:
    return list(dict.fromkeys(b for seq in seqs for b in seq.block_ids))


def move(seqs: list[SeqBlocks], src: BlockPool, dst: BlockPool, to_gpu: bool,
         op: str, what: str) -> list[tuple[int, int]]:
    """Move a group from src to dst: (src block, dst block) per distinct block, src refs
    released tail-first; back on the GPU, full blocks are re-cached."""
    distinct = distinct_blocks(seqs)
    if len(distinct) > dst.num_free_blocks:
        raise ValueError(
            f"{op} needs {len(distinct)} blocks, only {dst.num_free_blocks} {what} are free; "
            f"check can_{op} first"
        )
    new_blocks = dst.get_new_blocks(len(distinct))
    remap: dict[int, KVCacheBlock] = {}
    for old, new in zip(distinct, new_blocks):
        new.ref_cnt = 0
        remap[old] = new
    for seq in seqs:
        src.free_blocks(src.blocks[b] for b in reversed(seq.block_ids))
        for b in seq.block_ids:
            remap[b].ref_cnt += 1
        seq.block_ids = [remap[b].block_id for b in seq.block_ids]
        seq.swapped = not to_gpu
        if to_gpu:
            for i, h in enumerate(seq.block_hashes):
                block = dst.blocks[seq.block_ids[i]]
                if block.block_hash is None:  # a block shared in the group is cached once
                    dst.cache_block(block, h)
    return [(old, remap[old].block_id) for old in distinct]
