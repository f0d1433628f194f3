"""Where every block is: its tier, its holders, its content key, and each tier's arrival order."""

from __future__ import annotations

from itertools import repeat
from typing import Container, Iterator, Sequence

from kvstore.blocks.table import DROPPED, LayerTable

Holder = tuple[int, int, int]  # (sequence, layer, block index): one table entry pointing at a block


class BlockRegistry:
    """Global block ids -> (tier index, holders, content key). Plain dicts: the store touches it per block
    move, never per token, and the decode path reads the per-table device maps instead.

    A block is held by every table entry that points at it (a forked or prefix-started sequence shares
    its full blocks); its reference count is the number of holders, and it is freed when the last one
    lets go. A full block whose token ids are known carries a content key (layer + hash chain of its
    tokens, kvstore/contexts/sequences.py); `find` maps a key back to a block holding that content."""

    def __init__(self, num_tiers: int) -> None:
        self.tier_of: dict[int, int] = {}  # block id -> index into KVStore.tiers
        # block id -> the table entry pointing at it, or a frozenset of them when several do: no set per block
        # (an opened million-block context would make a million, each one more object for every GC pass)
        self.holders: dict[int, Holder | frozenset[Holder]] = {}
        self.order: list[dict[int, None]] = [{} for _ in range(num_tiers)]  # per tier, oldest arrival first
        self.key_of: dict[int, bytes] = {}  # block id -> content key (full blocks of known tokens)
        self.by_key: dict[bytes, int] = {}  # content key -> the first block keyed with it, still stored
        self.also_keyed: dict[bytes, dict[int, None]] = {}  # content key -> later blocks carrying it, in order
        self._next = 0

    def new_ids(self, n: int, seq: int, layer: int, first_index: int) -> list[int]:
        """n new block ids, held by entries first_index, first_index + 1, ... of table (seq, layer)."""
        return self.new_ids_for(list(zip(repeat(seq), repeat(layer), range(first_index, first_index + n))))

    def new_ids_for(self, holders: Sequence[Holder]) -> list[int]:
        """A new block id for each table entry of `holders`, held by it (a step's new tail in every layer)."""
        ids = list(range(self._next, self._next + len(holders)))
        self._next += len(holders)
        self.holders.update(zip(ids, holders))
        return ids

    def holders_of(self, block_id: int) -> tuple[Holder] | frozenset[Holder]:
        """The table entries pointing at a block (none for a block no table holds)."""
        held = self.holders.get(block_id, ())
        return held if type(held) is frozenset or not held else (held,)

    def hold(self, block_id: int, holder: Holder) -> None:
        """One more table entry points at a recorded block."""
        if block_id not in self.tier_of:
            raise KeyError(f"block {block_id} is in no tier: it cannot be shared")
        self.holders[block_id] = frozenset((*self.holders_of(block_id), holder))

    def let_go(self, block_id: int, holder: Holder) -> bool:
        """`holder` no longer points at the block; True when nothing holds it now (the caller frees it)."""
        held = self.holders_of(block_id)
        if holder not in held:
            raise KeyError(f"block {block_id} is not held by {holder}")
        rest = [h for h in held if h != holder]
        self.holders[block_id] = rest[0] if len(rest) == 1 else frozenset(rest)
        return not rest

    def refcount(self, block_id: int) -> int:
        held = self.holders.get(block_id, ())
        return len(held) if type(held) is frozenset else 1 if held else 0

    def entries_per_table(self, ids: Sequence[int]) -> dict[tuple[int, int], int]:
        """(sequence, layer) -> how many of its table's entries hold one of `ids` (one dict read per block: a
        sequence's blocks counted at once when it is freed)."""
        tally: dict[tuple[int, int], int] = {}
        for held in map(self.holders.get, ids):
            for seq, layer, _ in held if type(held) is frozenset else (held,) if held else ():
                tally[seq, layer] = tally.get((seq, layer), 0) + 1
        return tally

    def any_holder(self, block_id: int) -> Holder:
        """One table entry holding the block (each holds the same content)."""
        return next(iter(self.holders_of(block_id)))

    def record(self, ids: Sequence[int], tier: int) -> None:
        """`ids` now live in `tier` (leaving the tier they were in, if any), in arrival order."""
        for block_id in [b for b in ids if b in self.tier_of]:
            del self.order[self.tier_of[block_id]][block_id]
        self.tier_of.update(dict.fromkeys(ids, tier))
        self.order[tier].update(dict.fromkeys(ids))

    def forget_owners(self, ids: Sequence[int]) -> None:
        """Ids handed out by new_ids that were never recorded in a tier (a refused append)."""
        for block_id in ids:
            del self.holders[block_id]

    def remove(self, ids: Sequence[int]) -> None:
        """`ids` are gone from every tier and every table."""
        for block_id in ids:
            del self.order[self.tier_of.pop(block_id)][block_id]
            del self.holders[block_id]
            key = self.key_of.pop(block_id, None)
            if key is not None:
                self._unkey(block_id, key)

    # -- content keys ----------------------------------------------------------------------
    def set_keys(self, ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """Full blocks' content keys; a block keyed already keeps its key (two independent prefills of one
        prompt give two blocks with one key: `find` returns the first still stored)."""
        fresh = {b: k for b, k in zip(ids, keys) if b not in self.key_of}
        self.key_of.update(fresh)
        first = dict(zip(fresh.values(), fresh))
        if len(first) == len(fresh) and self.by_key.keys().isdisjoint(first):  # no key carried twice: one update
            self.by_key.update(first)
            return
        for block_id, key in fresh.items():
            if self.by_key.setdefault(key, block_id) != block_id:
                self.also_keyed.setdefault(key, {})[block_id] = None

    def _unkey(self, block_id: int, key: bytes) -> None:
        later = self.also_keyed.get(key)
        if self.by_key[key] != block_id:
            del later[block_id]
        elif later:
            self.by_key[key] = next(iter(later))
            del later[self.by_key[key]]
        else:
            del self.by_key[key]
        if later is not None and not later:
            del self.also_keyed[key]

    def find(self, key: bytes) -> int | None:
        return self.by_key.get(key)

    def key(self, block_id: int) -> bytes | None:
        return self.key_of.get(block_id)

    # -- queries ---------------------------------------------------------------------------
    def by_tier(self, ids: Sequence[int]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for block_id in ids:
            groups.setdefault(self.tier_of[block_id], []).append(block_id)
        return groups

    def oldest(self, tier: int) -> Iterator[int]:
        return iter(self.order[tier])

    def sharing(self) -> dict[str, int]:
        """Blocks stored, table entries pointing at them, and blocks more than one entry holds."""
        several = [len(h) for h in self.holders.values() if type(h) is frozenset]
        return {"stored": len(self.holders), "references": len(self.holders) - len(several) + sum(several),
                "shared": sum(n > 1 for n in several)}

    def check(self, tiers: Sequence) -> None:
        for index, tier in enumerate(tiers):
            recorded = self.order[index]
            if tier.num_blocks != len(recorded) or any(i not in tier for i in recorded):
                raise AssertionError(f"{tier.name}: {tier.num_blocks} blocks stored, {len(recorded)} recorded")
        if sum(len(o) for o in self.order) != len(self.tier_of) or len(self.tier_of) != len(self.holders):
            raise AssertionError("block records disagree: a block is in two tiers or in none")
        unheld = [b for b in self.holders if not self.holders_of(b)]
        if unheld:
            raise AssertionError(f"blocks with a reference count of 0 are still stored: {unheld[:8]}")
        keyed = {(b, k) for k, b in self.by_key.items()} | {(b, k) for k, later in self.also_keyed.items()
                                                             for b in later}
        if keyed != set(self.key_of.items()) or not all(self.also_keyed.values()):
            raise AssertionError("content keys disagree with the blocks that carry them")

    # -- invariants ------------------------------------------------------------------------
    def check_tables(self, tables: dict[int, list[LayerTable]], block_tokens: int, hot_tier: int,
                     freeing: Container[int] = ()) -> None:
        """Raise AssertionError unless the registry and the block tables agree: every holder's table points
        back at the block, and every table's blocks, counts and device tier map match what is recorded.
        `freeing`: sequences being let go of from their tail (their tail block need not be hot)."""
        for block_id in self.holders:
            for seq, layer, i in self.holders_of(block_id):
                layers = tables.get(seq)
                if layers is None or i >= layers[layer].num_blocks or layers[layer].block_ids[i] != block_id:
                    raise AssertionError(f"block {block_id}: holder {(seq, layer, i)} does not point at it")
        for seq, layers in tables.items():
            for layer, table in enumerate(layers):
                self._check_table(f"seq {seq} layer {layer}", (seq, layer), table, block_tokens,
                                  None if seq in freeing else hot_tier)

    def _check_table(self, where: str, owner: tuple[int, int], table: LayerTable, block_tokens: int,
                     hot_tier: int | None) -> None:
        if table.num_blocks != -(-table.num_tokens // block_tokens):
            raise AssertionError(f"{where}: {table.num_blocks} blocks for {table.num_tokens} tokens")
        live = [(i, b) for i, b in enumerate(table.block_ids) if b != DROPPED]
        if any((*owner, i) not in self.holders_of(b) for i, b in live):
            raise AssertionError(f"{where}: a block does not count its table among its holders")
        if any(b not in self.tier_of for _, b in live):
            raise AssertionError(f"{where}: a table points at a block no tier holds")
        tiers = [self.tier_of[b] for _, b in live]
        counts = (sum(t == 1 for t in tiers), sum(t >= 2 for t in tiers), sum(t >= 3 for t in tiers),
                  table.block_ids.count(DROPPED))
        if counts != (table.num_warm, table.num_cold, table.num_far, table.num_dropped):  # 1 warm, 2 cpu, 3+ beyond
            raise AssertionError(f"{where}: warm/cold/far/dropped counts {counts} are stale")
        if hot_tier is not None and table.block_ids and tiers and self.tier_of.get(table.block_ids[-1]) != hot_tier:
            raise AssertionError(f"{where}: the tail block left the hot tier")
        if table.num_blocks:
            want = [-1] * table.num_blocks
            for (i, _), t in zip(live, tiers):
                want[i] = t
            if table.tier_map[: table.num_blocks].tolist() != want:
                raise AssertionError(f"{where}: the device tier map disagrees with the registry")
