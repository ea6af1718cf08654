"""Swapping groups of sequences between the GPU and CPU block pools.

A group (a request's live sequences) moves together so blocks shared by its sequences (after
a fork) move once and stay shared: each side's mapping lists every distinct block once.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.block_pool import BlockPool, KVCacheBlock
from kvcache.tables import SeqBlocks


class SwapMixin:
    """KVCacheManager's swap out / swap in. Mixed into KVCacheManager, whose state it shares
    (declared below)."""

    _seqs: dict[int, SeqBlocks]
    gpu_pool: BlockPool
    cpu_pool: BlockPool
    watermark_blocks: int

    def _group(self, seq_ids: Sequence[int], swapped: bool) -> list[SeqBlocks]:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"duplicate seq ids in swap group {list(seq_ids)}")
        group = []
        for sid in seq_ids:
            seq = self._seqs.get(sid)
            if seq is None:
                raise ValueError(f"unknown seq {sid} in swap group")
            if seq.swapped != swapped:
                state = "already swapped out" if seq.swapped else "not swapped out"
                raise ValueError(f"seq {sid} is {state}")
            group.append(seq)
        return group

    @staticmethod
    def _distinct_blocks(group: list[SeqBlocks]) -> list[int]:
        return list(dict.fromkeys(b for seq in group for b in seq.block_ids))

    def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
        """Whether the CPU pool can hold every distinct GPU block of the group."""
        group = self._group(seq_ids, swapped=False)
        return len(self._distinct_blocks(group)) <= self.cpu_pool.num_free_blocks

    def can_swap_in(self, seq_ids: Sequence[int]) -> bool:
        """Whether the group fits on the GPU with the watermark still free."""
        group = self._group(seq_ids, swapped=True)
        needed = len(self._distinct_blocks(group))
        return self.gpu_pool.num_free_blocks - needed >= self.watermark_blocks

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move a group to CPU: (gpu, cpu) per distinct GPU block; GPU refs released tail-first."""
        group = self._group(seq_ids, swapped=False)
        mapping = self._move(group, self.gpu_pool, self.cpu_pool, "swap_out", "CPU swap space")
        for seq in group:
            seq.swapped = True
        return mapping

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move a group back to GPU: (cpu, gpu) per distinct CPU block; full blocks re-cached."""
        group = self._group(seq_ids, swapped=True)
        mapping = self._move(group, self.cpu_pool, self.gpu_pool, "swap_in", "free GPU blocks")
        pool = self.gpu_pool
        for seq in group:
            seq.swapped = False
            for i, h in enumerate(seq.block_hashes):
                block = pool.blocks[seq.block_ids[i]]
                if block.block_hash is None:  # a block shared in the group is cached once
                    pool.cache_block(block, h)
        return mapping

    def _move(
        self, group: list[SeqBlocks], src: BlockPool, dst: BlockPool, op: str, what: str
    ) -> list[tuple[int, int]]:
        distinct = self._distinct_blocks(group)
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
        for seq in group:
            src.free_blocks(src.blocks[b] for b in reversed(seq.block_ids))
            for b in seq.block_ids:
                remap[b].ref_cnt += 1
            seq.block_ids = [remap[b].block_id for b in seq.block_ids]
        return [(old, remap[old].block_id) for old in distinct]
