"""Content keys: the hash chain that names a prompt's full blocks of token ids.

Block i of a prompt covers token ids [i*B, (i+1)*B). Its chain hash is

    h_i = blake2b-128(h_{i-1} || token ids of block i as little-endian int64),
    h_-1 = blake2b-128("kvtier-chain/1|" || model id || geometry || block_tokens)

so h_i names the whole prefix up to block i under one model. The store (kvstore/contexts/sequences.py)
keys block i of layer l as `l (2 bytes) || h_i`; the sidecar's prefix routes and the remote
Client key a chunk (every layer) by h_i alone. Both import this file, so the two agree.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

HASH_BYTES = 16


def chain_root(model_id: str, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
               block_tokens: int) -> bytes:
    """h_-1: what the chain starts from, so one model's keys never name another's blocks."""
    geometry = f"{model_id}|{num_layers}|{num_q_heads}|{num_kv_heads}|{head_dim}|{block_tokens}"
    return hashlib.blake2b(b"kvtier-chain/1|" + geometry.encode(), digest_size=HASH_BYTES).digest()


def chain_hashes(parent: bytes, token_ids: Sequence[int], block_tokens: int) -> list[bytes]:
    """Chain hashes of the full blocks of `token_ids` (a partial last block has none), after `parent`."""
    ids = np.asarray(token_ids, dtype="<i8")
    out = []
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        parent = hashlib.blake2b(parent + ids[start: start + block_tokens].tobytes(), digest_size=HASH_BYTES).digest()
        out.append(parent)
    return out


def block_key(layer: int, chain_hash: bytes) -> bytes:
    """The store's key of one layer's block: layer (2 bytes, big endian) || chain hash."""
    return layer.to_bytes(2, "big") + chain_hash


@dataclass(frozen=True, slots=True)
class ChunkKeys:
    """The model and chunk size a prompt's chain is hashed under: what a sidecar lookup needs to
    turn token ids into the same keys the engine stored its chunks under."""

    model_id: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"ChunkKeys.model_id must be a non-empty str, got {self.model_id!r}")
        for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 20:
                raise ValueError(f"ChunkKeys.{name} must be an int in [1, 2**20], got {value!r}")

    @property
    def root(self) -> bytes:
        return chain_root(self.model_id, self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim,
                          self.block_tokens)

    def hashes(self, token_ids: Sequence[int]) -> list[str]:
        """Hex chain hashes of the prompt's full chunks, in order (a partial last chunk has none)."""
        return [h.hex() for h in chain_hashes(self.root, token_ids, self.block_tokens)]

    def model(self) -> dict:
        """The model identity as the lookup route takes it."""
        return {"model_id": self.model_id, "num_layers": self.num_layers, "num_q_heads": self.num_q_heads,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}
