"""Remote tier: blocks in a kvtier sidecar (`kvtier serve`), through tiers/remote/client.py.

Each tier owns one namespace of the service (a fresh `kvstore-<random>` one unless it is
given one) and keeps a local index of the blocks it stored, so `in`, capacity and usage
never need a round trip. A block is one tensor under key `<id as 16 hex digits>`:
fp16 [2, H, B, D]; a quantized block is three, `<id>/<format>/data`, `.../k_scale` and `.../v_scale`
(tiers/layout.py: int8, fp8, int4). put/get/delete move a whole
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
from tiers.layout import QUANT_FORMATS, BlockLayout, Blocks, QuantBlocks, concat, format_of, num_blocks
from tiers.quant import one_format

_PARTS = ("data", "k_scale", "v_scale")


class RemoteTier(BudgetedTier):
    name = "remote"

    def __init__(
        self, layout: BlockLayout, url: str, capacity_bytes: int, token: str | None = None,
        namespace: str | None = None, timeout: float = 120.0,
    ) -> None:
        self.layout = layout
        self.block_bytes = layout.fp16_bytes
        self.max_value_bytes = self.block_bytes  # an fp16 block (a quantized one takes less)
        self.namespace = namespace or f"kvstore-{uuid.uuid4().hex[:16]}"
        self._capacity = capacity_bytes
        self.format_of: dict[int, str] = {}  # block id -> the format it is stored in
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
        self.part_shapes = {"": layout.field_specs("float16")[0]}  # key suffix -> (shape, dtype)
        for fmt in QUANT_FORMATS:
            self.part_shapes.update((f"{fmt}/{part}", spec) for part, spec in zip(_PARTS, layout.field_specs(fmt)))

    def keys(self, block_id: int) -> list[str]:
        base, fmt = f"{block_id:016x}", self.format_of[block_id]
        return [base] if fmt == "float16" else [f"{base}/{fmt}/{part}" for part in _PARTS]

    # -- protocol ------------------------------------------------------------------------
    def put(self, ids: Sequence[int], blocks: Blocks) -> None:
        self.layout.check(blocks)
        check_ids(ids, num_blocks(blocks), self.name)
        stored = [i for i in ids if i in self.format_of]
        if stored:
            raise ValueError(f"remote: block ids already stored: {stored[:8]}")
        fmt = format_of(blocks)
        need = len(ids) * self.layout.bytes_for(fmt)
        if self._used + need > self._capacity:
            raise MemoryError(f"remote tier: {need} more bytes exceed the capacity of {self._capacity}")
        blocks = blocks.to("cpu")
        if fmt != "float16":
            items = [(f"{i:016x}/{fmt}/{part}", t[row]) for row, i in enumerate(ids)
                     for part, t in zip(_PARTS, blocks.tensors())]
        else:
            items = [(f"{i:016x}", blocks[row]) for row, i in enumerate(ids)]  # each [2, H, B, D]
        self.client.put_many(self.namespace, items)
        self.format_of.update((i, fmt) for i in ids)
        self._used += need

    def get(self, ids: Sequence[int]) -> Blocks:
        """One batch from one request; a batch mixing formats comes back fp16."""
        missing = [i for i in ids if i not in self.format_of]
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
            if self.format_of[i] != "float16":
                parts.append(QuantBlocks(*(t[None] for t in tensors[at:at + 3])))
                at += 3
            else:
                parts.append(tensors[at][None])
                at += 1
        return concat(one_format(parts))

    def _check_parts(self, keys: list[str], tensors: list[torch.Tensor]) -> None:
        for key, t in zip(keys, tensors):
            shape, dtype = self.part_shapes[key.partition("/")[2]]  # "", or "<format>/<part>"
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise IntegrityError(f"remote: value {key!r} is {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}")

    def delete(self, ids: Sequence[int]) -> None:
        missing = [i for i in ids if i not in self.format_of]
        if missing:
            raise KeyError(f"remote: blocks not stored: {missing[:8]}")
        self.client.delete_many(self.namespace, [k for i in ids for k in self.keys(i)])
        for i in ids:
            self._used -= self.layout.bytes_for(self.format_of.pop(i))

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.format_of

    @property
    def num_blocks(self) -> int:
        return len(self.format_of)

    def check_integrity(self) -> None:
        """The local index, the byte count and the service's keys agree."""
        expected = {k for i in self.format_of for k in self.keys(i)}
        on_server = set(self.client.keys(self.namespace))
        if on_server != expected:
            raise AssertionError(f"remote tier: service holds {len(on_server - expected)} unknown and lacks "
                                 f"{len(expected - on_server)} expected values in {self.namespace!r}")
        if sum(self.layout.bytes_for(f) for f in self.format_of.values()) != self._used:
            raise AssertionError("remote tier: used bytes disagree with the block index")

    def close(self) -> None:
        """Delete this tier's blocks from the service (no table points at them once closed)."""
        ids = list(self.format_of)
        try:
            for start in range(0, len(ids), 4096):
                self.delete(ids[start: start + 4096])
        except UnreachableError as exc:
            warnings.warn(f"remote tier: could not delete {len(self.format_of)} blocks of {self.namespace!r}: {exc}")
        finally:
            self.client.close()
