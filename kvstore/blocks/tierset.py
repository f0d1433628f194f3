"""The tier set: the store's tiers and where every block lives (nano-vllm's BlockManager, for tiers).

It is asked to place, cool, promote, gather, drop and free blocks, and edits the block
tables it is handed (device slot and tier maps, warm/cold counts, through holders.py); it never
imports the store. Tiers by index (tier_stack.py): 0 hot (GPU fp16), 1 warm (GPU int8), 2 cpu,
3 cold (ssd, the sidecar or redis), 4 saved (read-only: blocks of opened saved contexts, read where
the save put them; never placed into). Placement levels (HOT, WARM, COLD) map onto the first three;
a COLD block starts in cpu and spills colder. A block may be held by several tables (forks,
prefixes): its moves update every holder's maps and counts, and it is deleted when the last holder
lets go. Every move is put-then-delete and every placement all-or-nothing: a failed put leaves each
block where it was, so no failure loses a block.
"""

from __future__ import annotations

from contextlib import contextmanager, suppress
from typing import Callable, Iterator, Sequence

import torch

from kvstore.blocks.demotion import Demotion
from kvstore.blocks.holders import Holders
from kvstore.blocks.placement import COLD, HOT, WARM, Placement
from kvstore.blocks.registry import BlockRegistry
from kvstore.blocks.table import DROPPED, LayerTable, TableTensors
from kvstore.blocks.tier_stack import COLD_TIER, CPU_TIER, HOT_TIER, SAVED_TIER, WARM_TIER, TierStack
from kvstore.config import Config
from tiers.base import device_ints
from tiers.errors import CapacityError
from tiers.layout import BlockLayout, Blocks, QuantBlocks
from tiers.quant import dequantize
from tiers.stored import MixedFormatTier

__all__ = ["COLD_TIER", "CPU_TIER", "HOT_TIER", "SAVED_TIER", "WARM_TIER", "TierSet"]  # indices: tier_stack.py
_FIRST_TIER = {HOT: HOT_TIER, WARM: WARM_TIER, COLD: CPU_TIER}


class TierSet:
    def __init__(self, config: Config, layout: BlockLayout, tables: dict[int, list[LayerTable]],
                 tensors: TableTensors) -> None:
        c = config
        self.layout, self.device = layout, torch.device(c.device)
        self.placement = Placement(c.block_tokens, c.sink_tokens, c.hot_tokens, c.warm_tokens)
        self.stack = TierStack(c, layout, self.placement)
        self.hot, self.warm, self.cpu, self.cold, self.saved = self.stack
        self.blocks = BlockRegistry(len(self.stack))
        self.holders = Holders(tables, self.blocks, tensors, self.stack)  # the tables' side of every move
        self._in_flight: set[int] = set()  # blocks being moved: in two tiers for a moment, never victims
        self.demotion = Demotion(self.holders, self.blocks, self.placement, self._in_flight)  # who cools first
        self.cooling_failures = 0  # cooling moves a full or failing colder tier refused
        # told (ids, tier) before blocks leave a tier (moved or freed): background saves copy those they still need
        self.leaving: list[Callable[[list[int], int], None]] = []

    # -- room ----------------------------------------------------------------------------
    def check_room(self, num_new: int) -> None:
        """Raise CapacityError, before anything changes, if `num_new` more blocks cannot be held."""
        if num_new > self.stack.free_blocks():
            raise CapacityError(f"no room for {num_new} more blocks in any tier (stats: {self.stack.stats()})")
        if not self.hot.free_blocks() and all(self.demotion.is_pinned(b) for b in self.blocks.oldest(HOT_TIER)):
            raise CapacityError(
                f"the hot pool's {self.hot.slots.num_slots} slots all hold tail blocks of live sequences; "
                "free a sequence or give the store more gpu_bytes"
            )

    def _make_room(self, tier: int, n: int) -> int:
        """Cool victims out of `tier` until n blocks fit (as far as colder tiers allow); returns how many fit."""
        deficit = n - self.stack[tier].free_blocks()
        if deficit > 0 and tier < COLD_TIER:
            victims = self.demotion.victims(tier, deficit)
            with suppress(CapacityError):  # colder tiers full too: fewer fit here, the caller spills or refuses
                if victims:
                    self.move(victims, tier, tier + 1)
        return min(n, self.stack[tier].free_blocks())

    # -- moves ---------------------------------------------------------------------------
    def place(self, ids: list[int], blocks: Blocks, tier: int, coldest: int | None = None) -> None:
        """Put blocks into `tier`; what does not fit goes one tier colder (down to `coldest`), oldest
        first. All or nothing: on any failure no block of `ids` is stored anywhere new."""
        plan = self._plan(len(ids), tier, COLD_TIER if coldest is None else coldest)
        done: list[tuple[int, int, int]] = []
        try:
            for t, lo, hi in plan:
                self.stack[t].put(ids[lo:hi], _rows(blocks, slice(lo, hi)))
                done.append((t, lo, hi))
        except BaseException as exc:
            for t, lo, hi in done:
                self.stack[t].delete(ids[lo:hi])
            self._discard_partial(ids, plan[len(done)])
            if isinstance(exc, MemoryError):  # a tier's own budget (bytes after compression, host memory)
                name = self.stack[plan[len(done)][0]].name
                raise CapacityError(f"{name} tier refused {len(ids)} blocks: {exc}") from exc
            raise
        for t, lo, hi in done:
            self._record(ids[lo:hi], t)

    def _discard_partial(self, ids: list[int], step: tuple[int, int, int]) -> None:
        """A tier's put is all-or-nothing by contract; if one broke it (a connection lost mid-batch),
        take back what landed, as far as the tier still answers."""
        tier, lo, hi = step
        try:
            landed = [i for i in ids[lo:hi] if i in self.stack[tier]]
            if landed:
                self.stack[tier].delete(landed)
        except Exception:  # noqa: BLE001 -- the put's own error is the one to report
            pass

    def _plan(self, n: int, tier: int, coldest: int) -> list[tuple[int, int, int]]:
        """[(tier, lo, hi)]: rows [lo, hi) of the batch go to `tier`; the oldest rows spill colder."""
        room = self._make_room(tier, n)
        spill = n - room
        plan = []
        if spill:
            if tier >= coldest:
                raise CapacityError(f"{self.stack[tier].name} tier is full ({spill} of {n} blocks do not fit)")
            plan = self._plan(spill, tier + 1, coldest)
        return plan + ([(tier, spill, n)] if room else [])

    def move(self, ids: list[int], src: int, dst: int, coldest: int | None = None, keep_format: bool = True) -> None:
        """Move blocks between tiers: put in `dst` (or colder, down to `coldest`, but never back into `src`),
        then delete from `src`. Into a GPU pool from a host-side tier, the source delivers on the device itself
        (pinned buffers, the cpu tier's gather kernel) rather than through pageable host memory. From a tier
        holding both formats (ssd, saved) each block moves in the format it was stored in, one put per format
        (an error in the second leaves the first moved); keep_format: put_moved's."""
        into_gpu, source = dst < CPU_TIER <= src, self.stack[src]
        if keep_format and isinstance(source, MixedFormatTier):  # verified: a damaged block raises here, before
            parts = source.fetch_as_stored(ids, self.device if into_gpu else "cpu").parts()  # anything moved
        else:
            parts = [(range(len(ids)), source.fetch(ids, self.device) if into_gpu else source.get(ids))]
        for at, blocks in parts:
            self.put_moved([ids[i] for i in at], blocks, src, dst, coldest, keep_format)

    def put_moved(self, ids: list[int], blocks: Blocks, src: int, dst: int, coldest: int | None = None,
                  keep_format: bool = True) -> None:
        """The second half of `move`: blocks the caller read from `src` (verified) go into `dst` (or colder), then
        leave `src`. keep_format: blocks already in the warm format go no higher than the warm tier (home_tier;
        those in it already stay)."""
        if keep_format and (home := self.home_tier(blocks, dst)) != dst:
            if home == src:
                return
            dst, coldest = home, None if coldest is None else max(coldest, home)
        with self._moving(ids):
            self.place(ids, blocks, dst, coldest=coldest if coldest is not None else src - 1 if dst < src else None)
        for told in self.leaving:
            told(ids, src)
        self.stack[src].delete(ids)
        self.holders.count(ids, src, -1)

    @contextmanager
    def _moving(self, ids: Sequence[int]) -> Iterator[None]:
        self._in_flight.update(ids)
        try:
            yield
        finally:
            self._in_flight.difference_update(ids)

    def promote(self, ids: list[int], dst: int = WARM_TIER) -> int:
        """Move cold blocks up to `dst` where room can be made; none of them is picked as a victim
        meanwhile. Opportunistic: a group that does not fit stays where it is. Returns how many moved."""
        moved = 0
        with self._moving(ids):
            for src, group in self.blocks.by_tier(ids).items():
                if src > dst:
                    try:
                        self.move(group, src, dst)
                    except CapacityError:
                        continue
                    moved += len(group)
        return moved

    def cool(self, table: LayerTable, old_tokens: int, new_tokens: int | None = None) -> None:
        """Demote blocks of `table` that left the hot or warm window as it grew from `old_tokens` to
        `new_tokens` (default: its length now; a captured step cools just before its token lands).
        Best effort, after an append that has already succeeded: when a colder tier is full or
        fails, the blocks stay hotter than their window (counted in `cooling_failures`); the next
        append's room check refuses cleanly if that leaves no room, and a broken tier shows on use."""
        self.cool_tables([(table, old_tokens, table.num_tokens if new_tokens is None else new_tokens)])

    def cool_tables(self, growth: Sequence[tuple[LayerTable, int, int]]) -> None:
        """`cool` for many tables at once, (table, old_tokens, new_tokens) each: one move per pair of tiers for
        all of them (the layers of a decode step, the sequences of a batch), not one per table."""
        wanted: dict[tuple[int, int], list[int]] = {}
        for table, old_tokens, new_tokens in growth:
            for index in self.placement.crossing(old_tokens, new_tokens, table.num_blocks):
                block_id = table.block_ids[index]
                if block_id == DROPPED:
                    continue
                want = min(self.first_tier(i, new_tokens if t is table else t.num_tokens)
                           for t, i in self.holders.tables_of(block_id))  # a shared block: its hottest holder's tier
                current = self.blocks.tier_of[block_id]
                if current < want:
                    wanted.setdefault((current, want), []).append(block_id)
        for (src, dst), ids in wanted.items():
            try:
                self.move(list(dict.fromkeys(ids)), src, dst)  # a block shared by two tables moves once
            except Exception:  # noqa: BLE001 -- move() left every block where it was; see cool's docstring
                self.cooling_failures += 1
                return

    def first_tier(self, index: int, num_tokens: int) -> int:
        """The tier block `index` of a `num_tokens`-token sequence belongs in (cold blocks start in cpu)."""
        return _FIRST_TIER[self.placement.level(index, num_tokens)]

    def home_tier(self, blocks: Blocks, tier: int) -> int:
        """Where `blocks` bound for `tier` go: the warm tier in place of the hot one for blocks already in the warm
        format (fp16 adds no precision; cooled again, an int4 block's values would be quantized a second time,
        which does not always give back its codes: docs/tiers.md)."""
        quantized = isinstance(blocks, QuantBlocks) and blocks.fmt == self.warm.format
        return WARM_TIER if tier == HOT_TIER and quantized else tier

    def _record(self, ids: Sequence[int], tier: int) -> None:
        """Book `ids` into `tier`; their holders' device maps and counts follow."""
        self.blocks.record(ids, tier)
        self.holders.count(ids, tier, +1)
        self.holders.point(ids, tier)

    # -- reads and frees -----------------------------------------------------------------
    def gather(self, ids: Sequence[int], device: torch.device) -> torch.Tensor:
        """fp16 blocks [n, 2, H, B, D] on `device`, from whichever tiers hold them (verified)."""
        out = self.layout.empty_fp16(len(ids), device)
        position = {block_id: i for i, block_id in enumerate(ids)}
        for tier, group in self.blocks.by_tier(ids).items():
            blocks = self.stack[tier].fetch(group, device)
            if isinstance(blocks, QuantBlocks):
                blocks = dequantize(blocks)
            out[device_ints([position[i] for i in group], device)] = blocks
        return out

    def delete(self, ids: Sequence[int]) -> None:
        for tier, group in self.blocks.by_tier(ids).items():
            for told in self.leaving:
                told(group, tier)
            self.stack[tier].delete(group)
            self.holders.count(group, tier, -1)
        self.blocks.remove(ids)

    def release(self, seq: int, layer: int, indices: Sequence[int]) -> None:
        """Entries `indices` of the table (seq, layer) let go of their blocks; a block no other table holds
        is deleted from its tier. The table's counts follow; its block ids and maps are the caller's."""
        self.delete(self.holders.let_go(seq, layer, indices))

    def copy_into(self, table: LayerTable, seq: int, layer: int, index: int) -> None:
        """Entry `index` of `table`, registered as (seq, layer), gets its own copy of the block it points at, in
        the hot tier (copy-on-write of a shared partial tail); CapacityError, the entry unchanged, if no room."""
        old = table.block_ids[index]
        blocks = self.gather([old], self.device)  # [1, 2, H, B, D] fp16
        table.block_ids[index] = self.blocks.new_ids(1, seq, layer, index)[0]
        try:
            self.place([table.block_ids[index]], blocks, HOT_TIER, coldest=HOT_TIER)
        except BaseException:
            self.blocks.forget_owners([table.block_ids[index]])
            table.block_ids[index] = old
            raise

    def pin_tail(self, table: LayerTable) -> None:
        """Bring the table's tail block into the hot tier, where tails live (a full one too: DecodeStep
        addresses the tail by its hot slot); CapacityError if the hot pool cannot take it."""
        if table.block_ids and self.blocks.tier_of[table.block_ids[-1]] != HOT_TIER:
            self.move([table.block_ids[-1]], self.blocks.tier_of[table.block_ids[-1]], HOT_TIER, coldest=HOT_TIER,
                      keep_format=False)

    def adopt_saved(self, tables: list[LayerTable], keys: list[bytes]) -> None:
        """The blocks of `tables` (new ids, each held by its entry alone; DROPPED aside) are the saved values under
        `keys`, in table order: nothing is read. Every block, or none."""
        live = [range(t.num_blocks) if not t.num_dropped else [i for i, b in enumerate(t.block_ids) if b != DROPPED]
                for t in tables]
        ids = [b for t in tables for b in t.block_ids if b != DROPPED]
        self.saved.adopt(ids, keys)
        self.blocks.record(ids, SAVED_TIER)
        for table, indices in zip(tables, live):
            self.holders.enter(table, indices, SAVED_TIER)  # their only holder: no per-block lookup

    def drop(self, table: LayerTable, indices: list[int]) -> None:
        """Free blocks of `table` for good (H2O drop mode); indices must be validated by the caller.
        A block another sequence shares stays stored for it."""
        if not indices:
            return
        self.release(*self.holders.owner(table, indices[0]), indices)
        for i in indices:
            table.block_ids[i] = DROPPED
        table.num_dropped += len(indices)
        self.holders.set_maps(table, indices, DROPPED)

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        """KVStore.stats's tier entries: blocks and bytes per tier, and the failures the tiers counted."""
        return {"tiers": self.stack.stats(), "integrity_errors": self.stack.integrity_errors,
                "missing_blocks": self.stack.missing_blocks, "cooling_failures": self.cooling_failures}

    def check_integrity(self) -> None:
        self.stack.check_integrity()
        self.blocks.check(self.stack)
        if self._in_flight:
            raise AssertionError(f"blocks left in flight between tiers: {sorted(self._in_flight)[:8]}")

    def close(self) -> None:
        self.stack.close()


def _rows(blocks: Blocks, rows: slice) -> Blocks:
    return blocks.index(rows) if isinstance(blocks, QuantBlocks) else blocks[rows]
