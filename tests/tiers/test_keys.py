"""Content keys: the hash chain of token-id blocks that the store and the sidecar's prefix routes share."""

from __future__ import annotations

import pytest

from tiers.keys import ChunkKeys, block_key, chain_hashes, chain_root

KEYS = ChunkKeys("m", num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=64, block_tokens=8)


def test_a_chunk_hash_names_its_whole_prefix():
    ids = list(range(1000, 1043))  # 5 full chunks of 8 and a partial one
    hashes = KEYS.hashes(ids)
    assert len(hashes) == 5 and len(set(hashes)) == 5 and all(len(h) == 32 for h in hashes)
    assert KEYS.hashes(ids[:24]) == hashes[:3]  # a prefix's chain is a prefix of the chain
    changed = list(ids)
    changed[9] = 7  # inside chunk 1: chunk 0 keeps its hash, every later one changes
    other = KEYS.hashes(changed)
    assert other[0] == hashes[0] and not set(other[1:]) & set(hashes)
    # the same tokens at another position (after another first chunk) hash differently
    assert KEYS.hashes(ids[8:16]) != [hashes[1]]


def test_the_root_binds_the_model_and_geometry():
    roots = {chain_root("m", 4, 8, 2, 64, 8), chain_root("m2", 4, 8, 2, 64, 8), chain_root("m", 5, 8, 2, 64, 8),
             chain_root("m", 4, 8, 4, 64, 8), chain_root("m", 4, 8, 2, 128, 8), chain_root("m", 4, 8, 2, 64, 16)}
    assert len(roots) == 6 and KEYS.root in roots
    assert chain_hashes(KEYS.root, list(range(8)), 8) == [bytes.fromhex(h) for h in KEYS.hashes(range(8))]
    assert block_key(3, KEYS.root) == b"\x00\x03" + KEYS.root


@pytest.mark.parametrize("field, value", [("model_id", ""), ("num_layers", 0), ("head_dim", 1.5),
                                          ("block_tokens", True), ("num_kv_heads", 1 << 21)])
def test_chunk_keys_refuse_bad_fields(field, value):
    fields = {"model_id": "m", "num_layers": 4, "num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64, "block_tokens": 8}
    with pytest.raises(ValueError, match=field):
        ChunkKeys(**{**fields, field: value})
