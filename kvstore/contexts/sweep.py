"""LMDB's content-keyed blocks: deleted once no manifest names them (Redis leaves that to maxmemory).

Saves in LMDB share full blocks under content keys (kvstore/contexts/save_blocks.py), so deleting a save's
own data leaves blocks that other saves may still name. Whatever may have orphaned some (a delete, a re-save,
a save killed before its commit) first records ctx/sweep; `sweep_blocks` then keeps every block that a
manifest names or a live sequence of this store reads (the saved tier's keys) and deletes the rest, and
clears the record last, so a sweep killed part way is done again by the next collect_garbage. It deletes
nothing while a manifest cannot be read (it might name any block) or another writer is saving (its new
manifest names blocks that no manifest names yet). One store per ssd_path (docs/contexts.md) makes the
second rare; a writer of this host that died is no writer.
"""

from __future__ import annotations

from typing import Callable, Iterable

from kvstore.contexts.opening import SavedReader
from kvstore.contexts.saved_format import BLOCK, MANIFEST
from tiers.errors import BlockMissingError, IntegrityError
from tiers.saved_values import LmdbValues

SWEEP = b"ctx/sweep"
_DELETE_BATCH = 16384  # keys per delete transaction


def sweep_needed(values: LmdbValues) -> None:
    """Record that content-keyed blocks may have lost their last manifest (before the step that may do it)."""
    values.put([(SWEEP, b"")])


def sweep_blocks(values: LmdbValues, reader: SavedReader, reading: Iterable[bytes],
                 other_writers: Callable[[], bool]) -> int:
    """Delete the content-keyed blocks no manifest names and `reading` (keys live sequences read) does not hold,
    if a sweep was recorded; returns how many went (0 too when it had to stop: a damaged manifest, another
    live writer)."""
    if values.get([SWEEP])[0] is None:
        return 0
    keep = {k for k in reading if k.startswith(BLOCK)}
    names = values.keys(MANIFEST)
    for key, raw in zip(names, values.get(names)):
        if raw is None:
            continue  # deleted meanwhile: it names nothing
        try:
            keep |= reader.content_keys(key[len(MANIFEST):].decode(errors="replace"), raw)
        except (IntegrityError, BlockMissingError):
            return 0  # a damaged manifest (or its token ids damaged or gone) might name any block: keep them all
    if other_writers():
        return 0
    gone = [k for k in values.keys(BLOCK) if k not in keep]
    for lo in range(0, len(gone), _DELETE_BATCH):
        values.delete(gone[lo: lo + _DELETE_BATCH])
    values.delete([SWEEP])
    return len(gone)
