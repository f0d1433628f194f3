"""The saved-context format: its keys, the checksummed manifest, block formats (kvstore/contexts/saving.py
writes it, kvstore/contexts/opening.py reads it back).

Keys (tiers/saved_values.py's values stores; Redis puts them under its PREFIX; the ssd tier's sweep of
stale blocks touches only b"kvstore/"):
    ctx/name/<name>                         manifest, committed last, in one write: a save is complete or
                                            absent; b"KVSM", xxh3-64 (u64 little endian) of its key and
                                            JSON, then the JSON: any damage, or a manifest under another
                                            name, is refused. It owns its save id's data and that of the
                                            ids in its "inherits"
    ctx/pending/<save id>                   a save in progress ({pid, host}); deleted with the commit
    ctx/pending/delete/<save id>            data to delete: xxh3-64 of key and name, then the name whose
                                            manifest owned it until a re-save or delete replaced it;
                                            written before that commit, deleted with the data
                                            (collect_garbage finishes what a writer killed after it left)
    ctx/block/<fmt u8><layer u16><chain>    a full block whose token ids are known (a save with a
                                            Config.model_id), under its content key (tiers/keys.py) and
                                            format (FORMAT_CODES), stored once (SET NX; LMDB: no overwrite)
                                            and shared by every save naming it; Redis's maxmemory policy
                                            removes it, LMDB's sweep (kvstore/contexts/sweep.py) once no
                                            manifest names it
    ctx/sweep                               LMDB: content-keyed blocks may have lost their last manifest
    ctx/data/<id>/b/<layer u16><index u64>  any other block of that save
    ctx/data/<id>/m/<layer u16><part u32>   key summaries fp16 [p, 2, H, D] of PART_BYTES-sized parts
    ctx/data/<id>/h/<layer u16>             H2O scores fp32 [H, n]
    ctx/data/<id>/k/<layer u16><part u32>   key sketch codes uint8 [p, H, 2, B, D/4]
    ctx/data/<id>/t                         token ids, int64 little endian
Block values are tiers/saved.py's `seal(key, codec value)`: they name their key, and the codec value
(checksummed, in the format its tier held: fp16, or int8 from warm/cpu) follows; the manifest holds the
format of each content-keyed block ("int8": a bitmap) and the xxh3-64 of every other value's key and
bytes. A value read under another key is refused (IntegrityError); so is a save of an older format
(ValueError: save it again).
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket

import numpy as np
import xxhash

from tiers.errors import IntegrityError
from tiers.keys import block_key
from tiers.layout import FORMAT_CODES
from tiers.saved_values import LmdbValues, RedisValues

NAME = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
SAVE_ID = re.compile(r"[0-9a-f]{32}")
MANIFEST, DATA, PENDING, BLOCK = b"ctx/name/", b"ctx/data/", b"ctx/pending/", b"ctx/block/"
RETIRED = PENDING + b"delete/"  # beside the writers' records: collect_garbage finds both in one scan
VERSION = 4  # 4: values name their keys, manifests are checksummed, content keys name the format; older: refused
_SEALED = b"KVSM"
Values = LmdbValues | RedisValues


def check_name(name: object) -> None:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"a saved context's name must match {NAME.pattern}, got {name!r}")


def value_digest(key: bytes, value: bytes | memoryview) -> int:
    """xxh3-64 of a value's key and bytes (streamed): the digest names where the value belongs."""
    h = xxhash.xxh3_64()
    h.update(key)
    h.update(value)
    return h.intdigest()


def seal_manifest(name: str, manifest: dict) -> bytes:
    body = json.dumps(manifest).encode()
    return _SEALED + value_digest(MANIFEST + name.encode(), body).to_bytes(8, "little") + body


def unseal_manifest(name: str, raw: bytes | memoryview) -> dict:
    """The manifest stored as `name`. IntegrityError if it is damaged or was stored under another name;
    ValueError if an older kvtier wrote it."""
    raw = bytes(raw)
    if raw.startswith(b'{"version": '):
        raise ValueError(f"saved context {name!r} was saved by an older kvtier (format 3 or before; this one reads "
                         f"format {VERSION}): save it again")
    if raw[:4] != _SEALED or len(raw) < 12 or \
            int.from_bytes(raw[4:12], "little") != value_digest(MANIFEST + name.encode(), raw[12:]):
        raise IntegrityError(f"saved context {name!r}: its manifest is damaged (or was stored under another name)")
    return json.loads(raw[12:])


def owned_ids(name: str, raw: bytes | memoryview | None) -> list[str] | None:
    """The save ids whose data the manifest of `name` owns: its own and those it inherited (none for no
    manifest; None when that cannot be read: a damaged manifest). Read from an older format's too, so that
    replacing or deleting such a save frees its data."""
    if raw is None:
        return []
    try:
        m = unseal_manifest(name, raw)
    except IntegrityError:
        return None
    except ValueError:
        try:
            m = json.loads(bytes(raw))
        except ValueError:
            return None
    ids = [m.get("save_id"), *m.get("inherits", [])] if isinstance(m, dict) else [None]
    return ids if all(isinstance(s, str) and SAVE_ID.fullmatch(s) for s in ids) else None


def token_bytes(token_ids: list[int] | None) -> bytes | None:
    """The value of a save's token ids (ctx/data/<id>/t)."""
    return None if token_ids is None else np.asarray(token_ids, dtype="<i8").tobytes()


def scores_item(data: bytes, layer: int, scores: bytes) -> tuple[bytes, bytes]:
    """The value of a layer's H2O scores (fp32 [H, n] bytes) under the save's data prefix `data`."""
    return data + b"h/" + layer.to_bytes(2, "big"), scores


def part_items(data: bytes, layer: int, part: int, summaries: bytes, codes: bytes) -> list[tuple[bytes, bytes]]:
    """The values of one part of a layer's key summaries and sketch codes (the part's rows, as bytes)."""
    at = layer.to_bytes(2, "big") + part.to_bytes(4, "big")
    return [(data + b"m/" + at, summaries), (data + b"k/" + at, codes)]


def layer_entry(num_tokens: int, num_blocks: int, formats: list[int], dropped: list[int], digests: list[int]) -> dict:
    """A layer's manifest entry; `digests`: value_digest of its scores_item, then of the part_items of every part in
    order."""
    return {"num_tokens": num_tokens, "num_blocks": num_blocks, "keyed": len(formats), "int8": pack_formats(formats),
            "dropped": dropped, "h_xxh3": digests[0], "m_xxh3": digests[1::2], "k_xxh3": digests[2::2]}


def content_key(layer: int, fmt: int, chain_hash: bytes) -> bytes:
    """Where a content-keyed block of one format is stored (shared by every save naming it)."""
    return BLOCK + bytes([fmt]) + block_key(layer, chain_hash)


def own_keys(data: bytes, layer: int, first: int, n: int) -> list[bytes]:
    """Keys of the save's own values (under `data`) of a layer's blocks [first, n): a million keys at once."""
    own = data + b"b/" + layer.to_bytes(2, "big")
    rows = np.empty((n - first, len(own) + 8), dtype=np.uint8)  # [n - first, key bytes]
    rows[:, :len(own)] = np.frombuffer(own, dtype=np.uint8)
    rows[:, len(own):] = np.arange(first, n, dtype=">u8").view(np.uint8).reshape(-1, 8)
    return rows.view(f"V{rows.shape[1]}").ravel().tolist()


def pack_formats(formats: list[int]) -> str:
    """Block formats (tiers/layout.py FORMAT_CODES) as the manifest holds them, base64: a bitmap while all are
    0 (fp16) or 1 (int8), else "B:" and a byte each (':' is no base64 character)."""
    if any(f > 1 for f in formats):
        return "B:" + base64.b64encode(bytes(formats)).decode()
    return base64.b64encode(np.packbits(np.asarray(formats, dtype=np.uint8)).tobytes()).decode()


def unpack_formats(text: str, n: int) -> list[int] | None:
    """pack_formats' n formats (None: the text does not hold n)."""
    if text.startswith("B:"):
        codes = list(base64.b64decode(text[2:]))
        return codes if len(codes) == n and all(c in FORMAT_CODES.values() for c in codes) else None
    bits = np.unpackbits(np.frombuffer(base64.b64decode(text), dtype=np.uint8))
    return bits[:n].tolist() if len(bits) == -(-n // 8) * 8 else None


def writer_record() -> bytes:
    """ctx/pending/<save id> of a save this process writes: its pid and host."""
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()


def dead_here(info: bytes | None) -> bool:
    """Whether a pending save's writer ran on this host and is dead (a damaged record: not known to be)."""
    try:
        writer = json.loads(info)
        host, pid = writer["host"], writer["pid"]
    except (TypeError, ValueError, KeyError):
        return False
    if host != socket.gethostname() or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False
    return False


def retired_record(key: bytes, name: str) -> tuple[bytes, bytes]:
    """ctx/pending/delete/<save id> (`key`): the data goes once the manifest of `name` no longer owns it."""
    return key, value_digest(key, name.encode()).to_bytes(8, "little") + name.encode()


def retired_name(key: bytes, raw: bytes | None) -> str | None:
    """The name a retired record names (None: gone or damaged)."""
    if raw is None or len(raw) < 8 or int.from_bytes(raw[:8], "little") != value_digest(key, raw[8:]):
        return None
    return raw[8:].decode()
