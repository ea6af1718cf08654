"""What KVCacheManager keeps per sequence and returns (per allocation, and its stats)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcache.hashing import BlockHash

if TYPE_CHECKING:
    from kvcache.manager import KVCacheManager


@dataclass(slots=True)
class Allocation:
    """What one allocate_slots call changed in the sequence's GPU block table."""

    new_block_ids: list[int]  # appended to the table, in order
    copies: list[tuple[int, int]]  # copy-on-write (src, dst); dst replaced src in the table
    # Read-only: a step that changes nothing returns one shared instance whose lists raise
    # TypeError on mutation.


class _FrozenList(list):
    """An empty list that refuses mutation, so one 'nothing changed' Allocation can be shared."""

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("an Allocation's lists are read-only; copy them before changing them")

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse


# Most decode steps allocate nothing; sharing one result keeps them allocation-free.
NOTHING_NEW = Allocation(_FrozenList(), _FrozenList())


@dataclass(slots=True)
class SeqBlocks:
    """One sequence's block table and hash chain, as KVCacheManager keeps it (its invariants
    are in kvcache/manager.py's docstring)."""

    block_ids: list[int]
    num_slots: int
    block_hashes: list[BlockHash] = field(default_factory=list)
    extra_key: bytes | None = None
    swapped: bool = False
    # False guarantees the last block is not shared; True (set by fork) means "check ref_cnt".
    # Only fork shares a partially filled block, so decode steps skip touching the block.
    shared_tail: bool = False
    # Free slots in the last block: len(block_ids) * block_size - num_slots. Kept so a decode
    # step needs no arithmetic on (large, heap-allocated) token counts.
    tail_room: int = 0
    # The caller's precomputed hashes of leading full blocks (the request's prompt hashes,
    # read-only): blocks that fill later, in further prefill chunks, take theirs from here.
    known_hashes: Sequence[BlockHash] = ()


@dataclass(slots=True)
class KVCacheStats:
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    gpu_usage: float  # fraction of GPU blocks referenced by some sequence
    cpu_usage: float
    prefix_queries: int  # tokens queried (cumulative)
    prefix_hits: int  # tokens hit (cumulative)
    evictions: int  # cached blocks evicted (cumulative)
    # The CPU offload tier (kvcache/offload.py); zeros without one.
    num_offload_blocks: int = 0
    offload_usage: float = 0.0  # fraction of tier blocks holding a hash
    external_prefix_queries: int = 0  # tokens looked up in the tier after a GPU miss
    external_prefix_hits: int = 0  # of those, tokens loaded back from the tier
    blocks_offloaded: int = 0  # GPU -> tier copies (cumulative)
    blocks_loaded: int = 0  # tier -> GPU copies (cumulative)

    @classmethod
    def of(cls, kv: KVCacheManager) -> KVCacheStats:
        tier = kv.tier
        return cls(kv.num_gpu_blocks, kv.num_free_gpu_blocks, kv.num_cpu_blocks,
                   kv.num_free_cpu_blocks, kv.gpu_pool.usage(), kv.cpu_pool.usage(),
                   kv.prefix.queries, kv.prefix.hits, kv.gpu_pool.num_evictions,
                   *(() if tier is None else (tier.num_blocks, tier.usage(), tier.queries,
                                              tier.hits, tier.num_offloaded, tier.num_loaded)))
