"""Chained block hashes for prefix caching.

A full block's hash is xxh3-128 over (parent block hash, the block's token ids, extra key):

    h[0] = xxh3_128(ROOT_HASH || tokens[0:bs]       || extra_key)
    h[i] = xxh3_128(h[i-1]    || tokens[i*bs:(i+1)*bs] || extra_key)

so h[i] names the whole prefix tokens[0:(i+1)*bs] (plus the extra key, e.g. a cache salt),
not just block i. The encoding is unambiguous: the parent is always 16 bytes, the tokens
always block_size little-endian int32s, and the extra key is the remainder.

Collisions: hashes are 128-bit and are treated as impossible (birthday bound ~2^64 blocks);
token ids are NOT re-verified on a cache hit. Only full blocks are ever hashed.

Hashes are the 16-byte digests (`bytes`), which chain without int <-> bytes conversions.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

BlockHash = bytes
ROOT_HASH: BlockHash = bytes(16)  # the parent of block 0

_xxh3_128 = xxhash.xxh3_128_digest
_TOKEN = struct.Struct("<i")


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (the hashed representation)."""
    try:
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must fit in int32: {e}") from None


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_key: bytes | None = None
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    parent = ROOT_HASH if parent_hash is None else parent_hash
    return _xxh3_128(parent + pack_token_ids(token_ids) + (extra_key or b""))


def hash_packed_blocks(
    packed: bytes,
    block_size: int,
    start: int,
    stop: int,
    parent_hash: BlockHash | None,
    extra_key: bytes | None,
    out: list[BlockHash],
) -> None:
    """Append to `out` the chained hashes of blocks [start, stop) of `packed` (pack_token_ids).

    One slice + one xxh3 call per block; cost is linear in the number of blocks hashed.
    """
    prev = ROOT_HASH if parent_hash is None else parent_hash
    extra = extra_key or b""
    nbytes = block_size * _TOKEN.size
    append = out.append
    for off in range(start * nbytes, stop * nbytes, nbytes):
        prev = _xxh3_128(prev + packed[off : off + nbytes] + extra)
        append(prev)
