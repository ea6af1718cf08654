"""Chained block hashes for prefix caching.

A full block's hash is xxh3-128 over (parent block hash, the block's token ids, extra key):

    h[0] = xxh3_128(ROOT_HASH || tokens[0:bs]       || extra_key)
    h[i] = xxh3_128(h[i-1]    || tokens[i*bs:(i+1)*bs] || extra_key)

so h[i] names the whole prefix tokens[0:(i+1)*bs] (plus the extra key: a cache salt and the
LoRA adapter the KV was computed under, `extra_key`), not just block i. The encoding is unambiguous: the parent is always 16 bytes, the tokens
always block_size little-endian int32s, and the extra key is the remainder.

Collisions: hashes are 128-bit and are treated as impossible (birthday bound ~2^64 blocks);
token ids are NOT re-verified on a cache hit. Only full blocks are ever hashed.

Hashes are the 16-byte digests (`bytes`), which chain without int <-> bytes conversions.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import xxhash

BlockHash = bytes
ROOT_HASH: BlockHash = bytes(16)  # the parent of block 0

_xxh3_128 = xxhash.xxh3_128_digest

# Struct objects are cached per length: building one per call costs as much as packing a
# short prompt, and struct.pack(fmt, *ids) copies the argument tuple once more. The caches
# are cleared when they grow past _MAX_CACHED formats (prompt lengths vary freely).
_MAX_CACHED = 1024
_packers: dict[int, struct.Struct] = {}
_splitters: dict[tuple[int, int], struct.Struct] = {}


def _packer(n: int) -> struct.Struct:
    s = _packers.get(n)
    if s is None:
        if len(_packers) >= _MAX_CACHED:
            _packers.clear()
        s = _packers[n] = struct.Struct(f"<{n}i")
    return s


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (the hashed representation)."""
    try:
        return _packer(len(token_ids)).pack(*token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must fit in int32: {e}") from None


def split_blocks(packed: bytes, nbytes: int, start: int, stop: int) -> tuple[bytes, ...]:
    """Blocks [start, stop) of `packed` as separate `nbytes`-long bytes objects.

    One C call (struct.unpack_from) instead of one Python-level slice per block.
    """
    n = stop - start
    if n <= 0:
        return ()
    key = (nbytes, n)
    s = _splitters.get(key)
    if s is None:
        if len(_splitters) >= _MAX_CACHED:
            _splitters.clear()
        s = _splitters[key] = struct.Struct(f"{nbytes}s" * n)
    return s.unpack_from(packed, start * nbytes)


def chain_hashes(chunks: Sequence[bytes], parent: BlockHash, extra: bytes) -> list[BlockHash]:
    """Chained hashes of consecutive packed blocks, the first one's parent being `parent`."""
    h = parent
    if extra:
        return [h := _xxh3_128(h + c + extra) for c in chunks]
    return [h := _xxh3_128(h + c) for c in chunks]


def extra_key(cache_salt: str | None, lora_key: str | None = None) -> bytes | None:
    """The extra key of a request's blocks: its cache salt (UTF-8) and its LoRA adapter's
    identity (`LoRARequest.cache_key`: name and id), so one prompt under two adapters (or an
    adapter and the base model) never shares blocks. Without an adapter it is the salt alone
    (None: nothing). With one it starts with 0xFF, a byte UTF-8 never contains, then the
    key's length and the key: no salt can collide with an adapter's key."""
    salt = cache_salt.encode() if cache_salt else b""
    if lora_key is None:
        return salt or None
    name = lora_key.encode()
    return b"\xff" + struct.pack("<I", len(name)) + name + salt


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_key: bytes | None = None
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    return _hash_packed_block(parent_hash, pack_token_ids(token_ids), extra_key)


def _hash_packed_block(parent_hash: BlockHash | None, packed: bytes,
                       extra_key: bytes | None) -> BlockHash:
    return _xxh3_128((ROOT_HASH if parent_hash is None else parent_hash) + packed
                     + (extra_key or b""))


def block_hasher(
    block_size: int,
) -> Callable[[BlockHash | None, Sequence[int], bytes | None], BlockHash]:
    """hash_block_tokens for blocks of exactly block_size tokens, its packer built once (the
    decode step's block that just filled)."""
    pack = struct.Struct(f"<{block_size}i").pack

    def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int],
                   extra_key: bytes | None = None) -> BlockHash:
        try:
            packed = pack(*token_ids)
        except struct.error as e:
            raise ValueError(f"token ids must fit in int32: {e}") from None
        return _hash_packed_block(parent_hash, packed, extra_key)

    return hash_block


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

    Tokens are 4 bytes each. One xxh3 call per block; cost is linear in the number of blocks hashed.
    """
    chunks = split_blocks(packed, block_size * 4, start, stop)
    out.extend(chain_hashes(chunks, ROOT_HASH if parent_hash is None else parent_hash, extra_key or b""))


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, extra_key: bytes | None = None
) -> list[BlockHash]:
    """Chained hashes of every full block of token_ids (the partial last block is not hashed).

    What a request computes once, when it arrives, and hands to KVCacheManager.lookup_prefix
    and allocate_slots as `block_hashes`: its prompt is then never hashed on the scheduling path.
    """
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    n = num_full * block_size
    out: list[BlockHash] = []
    hash_packed_blocks(pack_token_ids(token_ids if len(token_ids) == n else token_ids[:n]),
                       block_size, 0, num_full, None, extra_key, out)
    return out
