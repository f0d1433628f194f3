"""Saving and opening a sharded sequence: each rank saves its shard with store.save, and a small manifest names the
shards and how the sequence was split.

Every rank makes the same call. A save:
    1. takes the name's sharded manifest away (a re-save that fails leaves the name absent, never a manifest
       over a mix of old and new shards),
    2. saves its shard as `shard_name(name, rank, world_size)` (store.save: durable, checksummed),
    3. exchanges (status, tokens per layer, save id) with the other ranks (one all_gather), and where every
       shard saved, writes the same sharded manifest into its store's saved values: the shards' ranges are
       committed before any manifest names them.
Opening reads and checks the manifest (the rank count must be the group's: ValueError otherwise), then every rank
opens its own shard and checks it is the one the manifest names. After each of the two steps the ranks exchange
their status, so a failure on one rank (a damaged shard: IntegrityError) is raised on every rank, of the same
class, and nothing stays opened; no rank is left waiting in a collective.

Key (tiers/saved_values.py's values, beside the saved contexts; kvstore/contexts/saved_format.py has the rest):
    ctx/sharded/<name>   b"KVSS", xxh3-64 (u64 little endian) of key and JSON, then the JSON: version, world_size,
                         block_tokens, starts (ShardPlan), lengths (the sequence's tokens per layer), geometry
                         [layers, q heads, kv heads, head_dim], shards [{name, save_id, num_tokens per layer}]
"""

from __future__ import annotations

import json

import torch

from kvstore.contexts.saved_format import check_name, value_digest
from kvstore.contexts.saving import SavedContexts
from kvstore.parallel.group import RankGroup
from kvstore.parallel.sequence import ShardedSequence
from kvstore.parallel.shards import ShardPlan
from kvstore.store import KVStore
from tiers.errors import IntegrityError

SHARDED = b"ctx/sharded/"
VERSION = 1
_SEALED = b"KVSS"
ERRORS = (ValueError, KeyError, IntegrityError)  # raised on every rank as the failing rank's class; others: 4


def shard_name(name: str, rank: int, world_size: int) -> str:
    """The saved context that holds `rank`'s shard of `name` over `world_size` ranks."""
    return f"{name}:rank{rank}-of{world_size}"


def save_sharded(sharded: ShardedSequence, name: str) -> None:
    """Save this rank's shard of `sharded` and, once every rank's shard is durable, the sharded manifest of
    `name`. Every rank calls it; on failure anywhere every rank raises and `name` is absent."""
    store, group = sharded.store, sharded.group
    shard, num_layers = shard_name(name, group.rank, group.world_size), store.spec.num_layers
    row = torch.zeros(num_layers + 3, dtype=torch.int64)  # [status, tokens per layer, save id as 2 int64]
    error = None
    try:
        check_name(name)
        check_name(shard)
        saved = _saved(store)
        saved.values.delete([SHARDED + name.encode()])
        store.save(sharded.seq, shard)
        row[1: 1 + num_layers] = torch.tensor([store.table(sharded.seq, layer).num_tokens
                                               for layer in range(num_layers)])
        save_id = bytearray.fromhex(saved.reader.read_manifest(shard)["save_id"])
        row[1 + num_layers:] = torch.frombuffer(save_id, dtype=torch.int64)
    except Exception as exc:  # noqa: BLE001 -- every rank learns of it below, then raises
        error, row[0] = exc, _code(exc)
    rows = group.all_gather(row.to(store.device)).cpu()  # [R, L + 3]
    _raise_if_failed(rows[:, 0], error, group.rank, f"save its shard of {name!r}")
    key = SHARDED + name.encode()
    body = json.dumps(_manifest(sharded, name, rows)).encode()
    saved.values.put([(key, _SEALED + value_digest(key, body).to_bytes(8, "little") + body)])
    saved.values.sync()


def _manifest(sharded: ShardedSequence, name: str, rows: torch.Tensor) -> dict:
    """The sharded manifest, from every rank's row [status, tokens per layer, save id] (rows [R, L + 3])."""
    world_size, num_layers = sharded.group.world_size, sharded.store.spec.num_layers
    shards = [{"name": shard_name(name, r, world_size), "num_tokens": rows[r, 1: 1 + num_layers].tolist(),
               "save_id": rows[r, 1 + num_layers:].numpy().tobytes().hex()} for r in range(world_size)]
    return {"version": VERSION, "world_size": world_size, "block_tokens": sharded.plan.block_tokens,
            "starts": list(sharded.plan.starts), "lengths": list(sharded.lengths),
            "geometry": _geometry(sharded.store), "shards": shards}


def open_sharded(store: KVStore, group: RankGroup, name: str) -> ShardedSequence:
    """This rank's part of the sharded context `name`: its shard opened in `store` (lazily, as store.open does).
    Every rank calls it. ValueError where the manifest's rank count, geometry or block size is not this group's
    and store's; IntegrityError where the manifest or any rank's shard is damaged; on every rank alike, with
    nothing opened."""
    manifest, seq, error = None, None, None
    try:
        manifest = read_sharded(store, name)
        _check_fits(manifest, store, group, name)
        shard = manifest["shards"][group.rank]
        if _saved(store).reader.read_manifest(shard["name"])["save_id"] != shard["save_id"]:
            raise ValueError(f"shard {shard['name']!r} was saved again after {name!r}: save {name!r} again")
    except Exception as exc:  # noqa: BLE001 -- every rank learns of it below, then raises
        error = exc
    _raise_if_failed(_exchange(group, store, error), error, group.rank, f"read the manifest of {name!r}")
    try:
        seq = store.open(shard["name"])
        plan = ShardPlan(manifest["block_tokens"], tuple(manifest["starts"]))
        sharded = ShardedSequence(store, group, plan, seq, manifest["lengths"])
    except Exception as exc:  # noqa: BLE001
        error = exc
        if seq is not None:
            store.free(seq)
    codes = _exchange(group, store, error)
    if error is None and bool(codes.any()):
        store.free(seq)
    _raise_if_failed(codes, error, group.rank, f"open its shard of {name!r}")
    return sharded


def read_sharded(store: KVStore, name: str) -> dict:
    """The verified sharded manifest of `name` in `store`'s saved values (KeyError: none; IntegrityError: damaged
    or stored under another name)."""
    check_name(name)
    key = SHARDED + name.encode()
    raw = _saved(store).values.get([key])[0]
    if raw is None:
        raise KeyError(f"no sharded context named {name!r}")
    raw = bytes(raw)
    if raw[:4] != _SEALED or len(raw) < 12 or int.from_bytes(raw[4:12], "little") != value_digest(key, raw[12:]):
        raise IntegrityError(f"sharded context {name!r}: its manifest is damaged (or was stored under another name)")
    return json.loads(raw[12:])


def delete_sharded(store: KVStore, group: RankGroup, name: str) -> None:
    """Take away the sharded manifest of `name` and this rank's shard (every rank calls it)."""
    check_name(name)
    saved = _saved(store)
    saved.values.delete([SHARDED + name.encode()])
    shard = shard_name(name, group.rank, group.world_size)
    if shard in saved.names():
        store.delete_saved(shard)


def _check_fits(manifest: dict, store: KVStore, group: RankGroup, name: str) -> None:
    if manifest.get("version") != VERSION:
        raise ValueError(f"sharded context {name!r} has format {manifest.get('version')!r}; this kvtier reads "
                         f"{VERSION}: save it again")
    if manifest["world_size"] != group.world_size:
        raise ValueError(f"sharded context {name!r} was saved over {manifest['world_size']} ranks; this group has "
                         f"{group.world_size} (open it with as many ranks as saved it)")
    if manifest["geometry"] != _geometry(store) or manifest["block_tokens"] != store.config.block_tokens:
        raise ValueError(f"sharded context {name!r} was saved with geometry {manifest['geometry']} and "
                         f"{manifest['block_tokens']}-token blocks; this store has {_geometry(store)} and "
                         f"{store.config.block_tokens}")


def _geometry(store: KVStore) -> list[int]:
    s = store.spec
    return [s.num_layers, s.num_q_heads, s.num_kv_heads, s.head_dim]


def _saved(store: KVStore) -> SavedContexts:
    if store.saved is None:
        raise ValueError("sharded contexts are saved beside the local ssd tier (Config.ssd_path) or Redis "
                         "(Config.redis_url); this store has neither")
    return store.saved


def _code(exc: BaseException) -> int:
    """1 + the index of exc's class in ERRORS (0 is success), or len(ERRORS) + 1."""
    return next((i + 1 for i, cls in enumerate(ERRORS) if isinstance(exc, cls)), len(ERRORS) + 1)


def _exchange(group: RankGroup, store: KVStore, error: BaseException | None) -> torch.Tensor:
    """int64 [R] on the CPU: every rank's status code (0: succeeded), exchanged on the store's device."""
    code = torch.tensor([0 if error is None else _code(error)], dtype=torch.int64, device=store.device)
    return group.all_gather(code)[:, 0].cpu()


def _raise_if_failed(codes: torch.Tensor, error: BaseException | None, rank: int, what: str) -> None:
    """Raise this rank's own error, or where another rank failed, an error of that rank's class."""
    if error is not None:
        raise error
    failed = [r for r, c in enumerate(codes.tolist()) if c]
    if failed:
        r, code = failed[0], int(codes[failed[0]])
        cls = ERRORS[code - 1] if code <= len(ERRORS) else RuntimeError
        raise cls(f"rank {r} could not {what} (its own error says why); nothing is opened or named here")
