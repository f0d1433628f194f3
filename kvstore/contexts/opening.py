"""Opening a saved context: reading back what kvstore/contexts/saving.py wrote, in the format of
kvstore/contexts/saved_format.py (its keys, the checksummed manifest, block formats).

Opening (`SavedReader.load`) reads the manifest and token ids; each layer's key summaries and H2O
scores, what a top-K (Quest) decode needs, are read by `SavedLayer.read_into` into the opened
table's own tensors: every value is checked against its xxh3 where it lies (LMDB: the mapped
pages, no copy) and copied once, straight in for a CPU store, else into pinned memory and on with
one host-to-device copy. Sketch codes load on first use (`SavedLayer.sketch` reads a range of rows;
kvstore/contexts/unread_codes.py tracks the rows not read yet, which a save of the opened sequence copies
from here) and blocks stay in the save until a step selects them (tiers/saved.py reads them in place; the
decode path then keeps them in a tier: kvstore/blocks/from_saved.py).
Deleting a saved context while a store has it open, or replacing it from another process, makes
that store's later reads of its blocks and codes fail (BlockMissingError). Redis shares content-keyed
blocks between stores: saving or opening there needs Config.model_id (ValueError without).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np
import torch

from kvstore.contexts.saved_format import DATA, MANIFEST, VERSION, Values, check_name, content_key, own_keys, \
    unpack_formats, unseal_manifest, value_digest
from tiers.errors import BlockMissingError, IntegrityError
from tiers.keys import chain_hashes
from tiers.layout import BlockLayout

ReadCodes = Callable[[int, int], torch.Tensor]  # (lo, hi) -> uint8 [hi - lo, H, 2, B, D/4] on the CPU, read then
ReadInto = Callable[[torch.Tensor, torch.Tensor], None]  # (summaries fp16 [n, 2, H, D], H2O fp32 [H, n]), any device


@dataclass(slots=True)
class SavedLayer:
    num_tokens: int
    num_blocks: int
    dropped: list[int]  # block indices H2O drop mode had freed
    keys: list[bytes]  # the saved value of each block not dropped, in index order
    read_into: ReadInto  # reads and verifies the layer's summaries and H2O scores into the tensors given
    sketch: ReadCodes


@dataclass(slots=True)
class SavedContext:
    name: str
    token_ids: list[int] | None
    layers: list[SavedLayer]



class SavedReader:
    """Opens saved contexts of one model (`root`, named by `model_id`) and geometry from `values`."""

    def __init__(self, values: Values, layout: BlockLayout, root: bytes, model_id: str) -> None:
        self.values, self.root, self.model_id = values, root, model_id
        self.num_kv_heads, self.head_dim, self.block_tokens = layout.num_kv_heads, layout.head_dim, layout.block_tokens
        # SavedLayer.sketch of every layer load handed out and something (unread codes) still holds -> save id
        self.code_readers: weakref.WeakKeyDictionary[Callable, str] = weakref.WeakKeyDictionary()

    def check_model_id(self) -> None:
        """ValueError where content-keyed blocks would be shared without a model identity: two models of one
        geometry saving the same token ids would read each other's K/V."""
        if self.values.shared and not self.model_id:
            raise ValueError("Config.model_id is empty: saved contexts in Redis share blocks by content key with "
                             "every store on that Redis, so saving or opening there needs the weights' identity "
                             "(set Config.model_id to the checkpoint, e.g. 'meta-llama/Meta-Llama-3-8B')")

    def manifest(self, name: str) -> bytes | None:
        return self.values.get([MANIFEST + name.encode()])[0]

    def read_manifest(self, name: str) -> dict:
        """The verified manifest of `name` (KeyError: none)."""
        raw = self.manifest(name)
        if raw is None:
            raise KeyError(f"no saved context named {name!r} (saved: {self.names()[:16]})")
        return unseal_manifest(name, raw)

    def names(self) -> list[str]:
        return sorted(k[len(MANIFEST):].decode() for k in self.values.keys(MANIFEST))

    def load(self, name: str) -> SavedContext:
        """The manifest and token ids of `name`; each layer reads its summaries and H2O scores when handed the
        tensors to read them into (no block or sketch code is read)."""
        check_name(name)
        self.check_model_id()
        m = self.read_manifest(name)
        if m.get("version") != VERSION or m["root"] != self.root.hex() or \
                m["geometry"] != [self.num_kv_heads, self.head_dim, self.block_tokens]:
            raise ValueError(f"saved context {name!r} was saved by another model, geometry, block size or kvtier "
                             "version (Config.model_id, model, block_tokens must match the saving store's)")
        data = DATA + m["save_id"].encode() + b"/"
        token_ids = None
        if m["tokens_xxh3"] is not None:
            tokens = self._read(name, [data + b"t"], [m["tokens_xxh3"]], "token ids")
            token_ids = tokens.numpy().view("<i8").tolist()
        chain = chain_hashes(self.root, token_ids, self.block_tokens) if any(e["keyed"] for e in m["layers"]) else []
        layers = [self._layer(name, data, layer, entry, chain, m["part_blocks"])
                  for layer, entry in enumerate(m["layers"])]
        return SavedContext(name, token_ids, layers)

    def content_keys(self, name: str, raw: bytes | memoryview) -> set[bytes]:
        """The content keys of the blocks the manifest `raw` of `name` names (none for an older format, whose
        blocks are all the save's own). IntegrityError if the manifest or its token ids are damaged."""
        try:
            m = unseal_manifest(name, raw)
        except ValueError:
            return set()
        if not any(e["keyed"] for e in m["layers"]) or m["tokens_xxh3"] is None:
            return set()
        data = DATA + m["save_id"].encode() + b"/"
        tokens = self._read(name, [data + b"t"], [m["tokens_xxh3"]], "token ids").numpy().view("<i8").tolist()
        chain = chain_hashes(bytes.fromhex(m["root"]), tokens, self.block_tokens)
        return {content_key(layer, f, h) for layer, entry in enumerate(m["layers"])
                for f, h in zip(self._check_layer(name, layer, entry, len(chain)), chain)}

    def _layer(self, name: str, data: bytes, layer: int, entry: dict, chain: list[bytes],
               part_blocks: int) -> SavedLayer:
        n, dropped, keyed = entry["num_blocks"], entry["dropped"], entry["keyed"]
        formats = self._check_layer(name, layer, entry, len(chain))
        keys = [content_key(layer, f, h) for f, h in zip(formats, chain)] + own_keys(data, layer, keyed, n)
        if dropped:
            gone = set(dropped)
            keys = [k for i, k in enumerate(keys) if i not in gone]
        codes = partial(self._sketch, name, data, layer, entry, part_blocks)
        self.code_readers[codes] = data[len(DATA):-1].decode()
        return SavedLayer(entry["num_tokens"], n, sorted(dropped), keys,
                          partial(self._read_layer, name, data, layer, entry), codes)

    def _check_layer(self, name: str, layer: int, entry: dict, chained: int) -> list[int]:
        """The formats of the layer's content-keyed blocks; IntegrityError unless its entry is consistent in
        itself (checked before the store holds anything of the context): a block count that covers its
        tokens, dropped blocks in range and unique, content-keyed blocks that the token ids' hash chain
        reaches, each with its format."""
        n, tokens, dropped, keyed = entry["num_blocks"], entry["num_tokens"], entry["dropped"], entry["keyed"]
        formats = unpack_formats(entry["int8"], keyed) if 0 <= keyed <= min(n, chained) else None
        if n != -(-tokens // self.block_tokens) or len(set(dropped)) != len(dropped) or \
                any(not 0 <= i < n for i in dropped) or formats is None:
            raise IntegrityError(f"saved context {name!r}: layer {layer}'s manifest entry is damaged ({n} blocks, "
                                 f"{tokens} tokens, {len(dropped)} dropped, {keyed} content-keyed)")
        return formats

    def _read_layer(self, name: str, data: bytes, layer: int, entry: dict, summaries: torch.Tensor,
                    scores: torch.Tensor) -> None:
        """Summaries fp16 [n, 2, H, D] (contiguous) and H2O scores fp32 [H, n] of the layer, into the tensors given."""
        lay, what = layer.to_bytes(2, "big"), f"layer {layer}'s summaries"
        parts = [data + b"m/" + lay + p.to_bytes(4, "big") for p in range(len(entry["m_xxh3"]))]
        self._read(name, parts, entry["m_xxh3"], what, summaries)
        dense = scores if scores.is_contiguous() else torch.empty(scores.shape, dtype=scores.dtype, device=scores.device)
        self._read(name, [data + b"h/" + lay], [entry["h_xxh3"]], what, dense)
        if dense is not scores:
            scores.copy_(dense)

    def _sketch(self, name: str, data: bytes, layer: int, entry: dict, part_blocks: int, lo: int,
                hi: int) -> torch.Tensor:
        """uint8 [hi - lo, H, 2, B, D/4]: rows [lo, hi) of the layer's sketch codes, read now (the parts
        holding them)."""
        lay, first, last = layer.to_bytes(2, "big"), lo // part_blocks, -(-hi // part_blocks)
        parts = [data + b"k/" + lay + p.to_bytes(4, "big") for p in range(first, last)]
        codes = self._read(name, parts, entry["k_xxh3"][first:last], f"layer {layer}'s sketch codes")
        rows = codes.view(-1, self.num_kv_heads, 2, self.block_tokens, self.head_dim // 4)
        return rows[lo - first * part_blocks: hi - first * part_blocks]

    def _read(self, name: str, keys: list[bytes], digests: list[int], what: str,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """The values of `keys`, one after another, into `out` (contiguous, on any device) or a new uint8 CPU
        tensor: each is checked against the xxh3 of its key and bytes where it lies (LMDB: the mapped pages)
        and copied once."""
        return self.values.view(keys, partial(_copy_verified, f"saved context {name!r}: {what}", keys, digests, out))


def _copy_verified(what: str, keys: list[bytes], digests: list[int], out: torch.Tensor | None,
                   values: list) -> torch.Tensor:
    """Check each of `values` (buffers) against its key's digest and copy it on into `out` (or a new uint8 CPU tensor
    holding them all): straight in on the CPU; on CUDA through one pinned buffer and one host-to-device copy
    (queued: the caching host allocator keeps the buffer until it ran). A failure leaves `out` part written."""
    if any(v is None for v in values):
        raise BlockMissingError(f"{what} are gone (deleted or replaced after it was opened, or evicted by Redis's "
                                "maxmemory policy)")
    total = sum(len(v) for v in values)
    size = total if out is None else out.numel() * out.element_size()
    if total != size:  # more values than the geometry needs, or fewer: the manifest and the data disagree
        raise IntegrityError(f"{what} are damaged ({total} bytes where the manifest's geometry needs {size})")
    dst = torch.empty(size, dtype=torch.uint8) if out is None else out.view(-1).view(torch.uint8)
    host = dst if dst.device.type == "cpu" else torch.empty(size, dtype=torch.uint8, pin_memory=True)
    into, pos = host.numpy(), 0
    for key, value, want in zip(keys, values, digests):
        if value_digest(key, value) != want:
            raise IntegrityError(f"{what} are damaged (checksum mismatch)")
        into[pos: pos + len(value)] = np.frombuffer(value, dtype=np.uint8)
        pos += len(value)
    if host is not dst:
        dst.copy_(host, non_blocking=True)
    return dst
