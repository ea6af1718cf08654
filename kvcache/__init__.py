"""Paged KV-cache bookkeeping: block pools, prefix caching, swap and copy-on-write.

Pure Python (stdlib, xxhash, numpy); no torch, no model.
"""

from kvcache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from kvcache.hashing import hash_block_tokens, prompt_block_hashes
from kvcache.manager import KVCacheManager
from kvcache.tables import Allocation, KVCacheStats

__all__ = [
    "Allocation",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "KVCacheStats",
    "hash_block_tokens",
    "prompt_block_hashes",
]
