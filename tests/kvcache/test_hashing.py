import struct

import pytest
import xxhash

from kvcache import hash_block_tokens, prompt_block_hashes
from kvcache.hashing import ROOT_HASH, block_hasher, hash_packed_blocks, pack_token_ids


def test_hash_is_xxh3_128_over_parent_tokens_and_extra_key():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == xxhash.xxh3_128_digest(bytes(16) + struct.pack("<4i", 1, 2, 3, 4))
    h1 = hash_block_tokens(h0, [5, 6, 7, 8], b"salt")
    assert h1 == xxhash.xxh3_128_digest(h0 + struct.pack("<4i", 5, 6, 7, 8) + b"salt")
    assert len(h1) == 16 and ROOT_HASH == bytes(16)


def test_hash_depends_on_parent_and_extra_key():
    a = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(None, [1, 2], b"k") != a
    assert hash_block_tokens(None, (1, 2)) == a


def test_packed_chain_equals_block_by_block_chain():
    tokens = list(range(100, 112))
    out: list[bytes] = []
    hash_packed_blocks(pack_token_ids(tokens), 4, 0, 3, None, b"e", out)
    h = None
    expected = []
    for i in range(3):
        h = hash_block_tokens(h, tokens[4 * i : 4 * i + 4], b"e")
        expected.append(h)
    assert out == expected


def test_negative_token_id_is_a_value_error():
    with pytest.raises(ValueError, match="token ids must fit in int32"):
        hash_block_tokens(None, [-1 << 40])


def test_block_hasher_is_hash_block_tokens_for_its_block_size():
    hash4 = block_hasher(4)
    parent = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash4(None, [1, 2, 3, 4]) == parent
    assert hash4(parent, [5, 6, 7, 8], b"salt") == hash_block_tokens(parent, [5, 6, 7, 8], b"salt")
    with pytest.raises(ValueError, match="int32"):
        hash4(None, [1, 2, 3, 2**31])


def test_extra_key_separates_adapters_and_salts_and_keeps_a_salt_alone_as_before() -> None:
    from kvcache.hashing import extra_key

    assert extra_key(None) is None and extra_key("") is None
    assert extra_key("salt") == b"salt"  # what a salted request hashed with before adapters
    keys = [extra_key(s, a) for s in (None, "x", "\xff") for a in (None, "a", "ab", "b")]
    assert len(set(keys)) == len(keys)
    assert not any(extra_key(s, None).startswith(b"\xff") for s in ("x", "\xff", "\U0010ffff"))
    tokens = list(range(32))
    under = {a: prompt_block_hashes(tokens, 16, extra_key(None, a)) for a in (None, "a", "b")}
    assert len({h[0] for h in under.values()}) == 3
    assert under["a"] == prompt_block_hashes(tokens, 16, extra_key(None, "a"))
