"""Remote tier: blocks in a kvtier sidecar (`kvtier serve`), through tiers/remote/client.py.

Each tier owns one namespace of the service (a fresh `kvstore-<random>` one unless it is
given one) and keeps a local index of the blocks it stored, so `in`, capacity and usage
never need a round trip. A block is one tensor under key `<id as 16 hex digits>`:
fp16 [2, H, B, D]; an int8 block is three, `<id>/data` int8 [2, H, B, D],
`<id>/k_scale` f32 [H, D] and `<id>/v_scale` f32 [H, B]. put/get/delete move a whole
batch in one request. Values are checksummed end to end by the client and the service;
shapes and dtypes are checked again here, so a foreign value is never returned as a block.
"""

from __future__ import annotations

import uuid
import warnings
from typing import Sequence

import torch

from tiers.remote.client import Client, CorruptValueError, UnreachableError
from tiers.base import BudgetedTier, IntegrityError, check_ids
from tiers.layout import BlockLayout, Blocks, Int8Blocks, concat, num_blocks
from tiers.quant import one_format

_INT8_PARTS = ("data", "k_scale", "v_scale")


class RemoteTier(BudgetedTier):
    name = "remote"

    def __init__(
        self, layout: BlockLayout, url: str, capacity_bytes: int, token: str | None = None,
        namespace: str | None = None, timeout: float = 120.0,
    ) -> None:
        self.layout = layout
        self.block_bytes = layout.fp16_bytes
        self.max_value_bytes = self.block_bytes  # an fp16 block (an int8 one takes less)
        self.namespace = namespace or f"kvstore-{uuid.uuid4().hex[:16]}"
        self._capacity = capacity_bytes
        self.is_int8: dict[int, bool] = {}  # block id -> stored as int8 (else fp16)
        self._used = 0
        self.integrity_errors = 0
        self.client = Client(url, token=token, timeout=timeout)
        try:
            held = self.client.stats(self.namespace)["blocks"]  # also proves the token
        except UnreachableError as exc:
            self.client.close()
            raise ValueError(f"remote tier: no kvtier sidecar answers at {url!r} ({exc.detail})") from None
        except Exception:
            self.client.close()
            raise
        if held:
            self.client.close()
            raise ValueError(f"remote tier: namespace {self.namespace!r} already holds {held} values; "
                             "give each store its own namespace")
        h, b, d = layout.num_kv_heads, layout.block_tokens, layout.head_dim
        self.part_shapes = {"data": ((2, h, b, d), torch.int8), "k_scale": ((h, d), torch.float32),
                            "v_scale": ((h, b), torch.float32), "": ((2, h, b, d), torch.float16)}

    def keys(self, block_id: int) -> list[str]:
        base = f"{block_id:016x}"
        return [f"{base}/{part}" for part in _INT8_PARTS] if self.is_int8[block_id] else [base]

    # -- protocol ------------------------------------------------------------------------
    def put(self, ids: Sequence[int], blocks: Blocks) -> None:
        self.layout.check(blocks)
        check_ids(ids, num_blocks(blocks), self.name)
        stored = [i for i in ids if i in self.is_int8]
        if stored:
            raise ValueError(f"remote: block ids already stored: {stored[:8]}")
        int8 = isinstance(blocks, Int8Blocks)
        need = len(ids) * (self.layout.int8_bytes if int8 else self.layout.fp16_bytes)
        if self._used + need > self._capacity:
            raise MemoryError(f"remote tier: {need} more bytes exceed the capacity of {self._capacity}")
        blocks = blocks.to("cpu")
        if int8:
            items = [(f"{i:016x}/{part}", t[row]) for row, i in enumerate(ids)
                     for part, t in zip(_INT8_PARTS, blocks.tensors())]
        else:
            items = [(f"{i:016x}", blocks[row]) for row, i in enumerate(ids)]  # each [2, H, B, D]
        self.client.put_many(self.namespace, items)
        self.is_int8.update((i, int8) for i in ids)
        self._used += need

    def get(self, ids: Sequence[int]) -> Blocks:
        """One batch from one request; a batch mixing fp16 and int8 blocks comes back fp16."""
        missing = [i for i in ids if i not in self.is_int8]
        if missing:
            raise KeyError(f"remote: blocks not stored: {missing[:8]}")
        if not ids:
            return self.layout.empty_fp16(0, "cpu")
        keys = [k for i in ids for k in self.keys(i)]
        try:
            tensors = self.client.get_many(self.namespace, keys)
            self._check_parts(keys, tensors)
        except (CorruptValueError, IntegrityError):
            self.integrity_errors += 1
            raise
        parts, at = [], 0
        for i in ids:  # one part per block, in order
            if self.is_int8[i]:
                parts.append(Int8Blocks(*(t[None] for t in tensors[at:at + 3])))
                at += 3
            else:
                parts.append(tensors[at][None])
                at += 1
        return concat(one_format(parts))

    def _check_parts(self, keys: list[str], tensors: list[torch.Tensor]) -> None:
        for key, t in zip(keys, tensors):
            shape, dtype = self.part_shapes[key.partition("/")[2]]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise IntegrityError(f"remote: value {key!r} is {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}")

    def delete(self, ids: Sequence[int]) -> None:
        missing = [i for i in ids if i not in self.is_int8]
        if missing:
            raise KeyError(f"remote: blocks not stored: {missing[:8]}")
        self.client.delete_many(self.namespace, [k for i in ids for k in self.keys(i)])
        for i in ids:
            self._used -= self.layout.int8_bytes if self.is_int8.pop(i) else self.layout.fp16_bytes

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.is_int8

    @property
    def num_blocks(self) -> int:
        return len(self.is_int8)

    def check_integrity(self) -> None:
        """The local index, the byte count and the service's keys agree."""
        expected = {k for i in self.is_int8 for k in self.keys(i)}
        on_server = set(self.client.keys(self.namespace))
        if on_server != expected:
            raise AssertionError(f"remote tier: service holds {len(on_server - expected)} unknown and lacks "
                                 f"{len(expected - on_server)} expected values in {self.namespace!r}")
        size = {True: self.layout.int8_bytes, False: self.layout.fp16_bytes}
        if sum(size[v] for v in self.is_int8.values()) != self._used:
            raise AssertionError("remote tier: used bytes disagree with the block index")

    def close(self) -> None:
        """Delete this tier's blocks from the service (no table points at them once closed)."""
        ids = list(self.is_int8)
        try:
            for start in range(0, len(ids), 4096):
                self.delete(ids[start: start + 4096])
        except UnreachableError as exc:
            warnings.warn(f"remote tier: could not delete {len(self.is_int8)} blocks of {self.namespace!r}: {exc}")
        finally:
            self.client.close()
