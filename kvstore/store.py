"""KVStore: the KV cache of many sequences as fixed-size blocks across four tiers."""

from __future__ import annotations

import shutil
import tempfile
from typing import Sequence

import torch

from kvstore import decode
from kvstore.config import Config
from kvstore.placement import COLD, HOT, Placement
from kvstore.table import LayerTable, Summaries
from tiers.base import Tier
from tiers.cpu import CpuTier
from tiers.hot import HotTier
from tiers.layout import BlockLayout, Blocks, Int8Blocks
from tiers.quant import dequantize
from tiers.ssd import SsdTier
from tiers.warm import WarmTier

TIER_NAMES = ("hot", "warm", "cpu", "ssd")


class CapacityError(RuntimeError):
    """Every tier is full: the append was refused and nothing changed."""


class KVStore:
    def __init__(self, config: Config) -> None:
        c = self.config = config
        self.spec = c.model
        self.device = torch.device(c.device)
        self.layout = BlockLayout.of(c.model, c.block_tokens)
        self.placement = Placement(c.block_tokens, c.sink_tokens, c.hot_tokens, c.warm_tokens)
        hot_bytes, warm_bytes = self._split_gpu_bytes()
        self._tempdir = None if c.ssd_path or c.remote_url else tempfile.mkdtemp(prefix="kvtier-ssd-")
        self.tiers: list[Tier] = [
            HotTier(self.layout, hot_bytes, self.device),
            WarmTier(self.layout, warm_bytes, self.device),
            CpuTier(self.layout, c.cpu_bytes, c.cpu_dtype, pin=self.device.type == "cuda",
                    memory_reserve=c.host_memory_reserve),
            self._open_cold_tier(),
        ]
        self.hot, self.warm, self.cpu, self.cold = self.tiers
        self.tier_of: dict[int, int] = {}  # block id -> index into self.tiers
        self.owner: dict[int, tuple[int, int, int]] = {}  # block id -> (sequence, layer, block index)
        self.order: list[dict[int, None]] = [{} for _ in self.tiers]  # per tier, oldest arrival first
        self.sequences: dict[int, list[LayerTable]] = {}
        self.summaries = Summaries(c.model.num_kv_heads, c.model.head_dim, c.block_tokens, self.device)
        self._next_block = 0
        self._next_sequence = 0

    # -- construction ------------------------------------------------------------------------
    def _split_gpu_bytes(self) -> tuple[int, int]:
        """Split gpu_bytes between the hot and warm pools in proportion to one sequence's windows."""
        c, lay, p = self.config, self.layout, self.placement
        hot_blocks = c.model.num_layers * (p.sink_blocks + -(-c.hot_tokens // c.block_tokens) + 1)
        warm_blocks = c.model.num_layers * (c.warm_tokens // c.block_tokens)
        hot_need, warm_need = hot_blocks * lay.fp16_bytes, warm_blocks * lay.int8_bytes
        if c.gpu_bytes < hot_need:
            raise ValueError(
                f"gpu_bytes={c.gpu_bytes} is too small: one sequence needs {hot_need} bytes of hot blocks "
                f"(sinks + hot window + tail for {c.model.num_layers} layers at block_tokens={c.block_tokens})"
            )
        hot_bytes = c.gpu_bytes * hot_need // (hot_need + warm_need)
        return hot_bytes, c.gpu_bytes - hot_bytes

    def _open_cold_tier(self) -> Tier:
        c = self.config
        if c.remote_url:
            from tiers.remote import RemoteTier

            return RemoteTier(self.layout, c.remote_url, c.ssd_bytes, token=c.remote_token)
        ssd = SsdTier(self.layout, c.ssd_path or self._tempdir, c.ssd_bytes, c.ssd_compression,
                      c.ssd_level, sync=False, key_prefix=b"kvstore/")
        stale = list(ssd.sizes)  # blocks of an earlier store on this path: no table points at them
        if stale:
            ssd.delete_keys(stale)
        return ssd

    # -- sequences ---------------------------------------------------------------------------
    def create_sequence(self) -> int:
        seq = self._next_sequence
        self._next_sequence += 1
        self.sequences[seq] = [LayerTable() for _ in range(self.spec.num_layers)]
        return seq

    def _table(self, seq: int, layer: int) -> LayerTable:
        if seq not in self.sequences:
            raise KeyError(f"unknown sequence {seq!r} (never created or already freed)")
        if not isinstance(layer, int) or not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.spec.num_layers}), got {layer!r}")
        return self.sequences[seq][layer]

    def free(self, seq: int) -> None:
        """Return every block of `seq` to its tier."""
        self._table(seq, 0)
        for table in self.sequences.pop(seq):
            self._drop_blocks(table.block_ids)

    def _drop_blocks(self, ids: Sequence[int]) -> None:
        for level, group in self._group_by_tier(ids).items():
            self.tiers[level].delete(group)
            for block_id in group:
                del self.order[level][block_id]
        for block_id in ids:
            del self.tier_of[block_id], self.owner[block_id]

    # -- append ------------------------------------------------------------------------------
    def append(self, seq: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append k, v [T, kv_heads, head_dim] (fp16, on the store's device) to one layer."""
        table = self._table(seq, layer)
        self._check_kv(k, v)
        b = self.config.block_tokens
        fill = (-table.num_tokens) % b if table.block_ids else 0  # room left in the tail block
        head = min(fill, k.shape[0])
        num_new = -(-(k.shape[0] - head) // b)
        if num_new and num_new > sum(t.free_blocks() for t in self.tiers):
            raise CapacityError(f"no room for {num_new} more blocks in any tier (stats: {self.stats()['tiers']})")
        old_tokens = table.num_tokens
        if head:
            tail = len(table.block_ids) - 1
            self.hot.write_tokens(table.block_ids[tail], b - fill, k[:head], v[:head])
            self.summaries.extend_tail(table, tail, k[:head])
            table.num_tokens += head
        if num_new:
            self._append_blocks(seq, layer, table, k[head:], v[head:])
        self._cool(table, old_tokens)

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        h, d = self.spec.num_kv_heads, self.spec.head_dim
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or t.shape[1:] != (h, d) or t.shape[0] == 0:
                raise ValueError(f"{name} must have shape [T>0, {h}, {d}], got {list(t.shape)}")
            if t.dtype != torch.float16:
                raise ValueError(f"{name} must be torch.float16, got {t.dtype}")
            if t.device.type != self.device.type:
                raise ValueError(f"{name} must be on {self.device.type}, got {t.device}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")

    def _append_blocks(self, seq: int, layer: int, table: LayerTable, k: torch.Tensor, v: torch.Tensor) -> None:
        b, n = self.config.block_tokens, -(-k.shape[0] // self.config.block_tokens)
        blocks = torch.zeros((n, 2, self.spec.num_kv_heads, b, self.spec.head_dim),
                             dtype=torch.float16, device=self.device)  # [n, 2, H, B, D]
        kv = torch.stack([k, v])  # [2, T, H, D]
        full = (k.shape[0] // b) * b
        blocks[: full // b] = kv[:, :full].reshape(2, full // b, b, *k.shape[1:]).permute(1, 0, 3, 2, 4)
        if full < k.shape[0]:
            blocks[-1, :, :, : k.shape[0] - full] = kv[:, full:].transpose(1, 2)
        first = len(table.block_ids)
        ids = list(range(self._next_block, self._next_block + n))
        self._next_block += n
        self.summaries.write_new(table, first, k)
        table.block_ids.extend(ids)
        table.num_tokens += k.shape[0]
        for offset, block_id in enumerate(ids):
            self.owner[block_id] = (seq, layer, first + offset)
        levels = [self.placement.level(first + i, table.num_tokens) for i in range(n)]
        for level in (HOT, HOT + 1, COLD):
            positions = [i for i, lv in enumerate(levels) if lv == level]
            if positions:
                self._place([ids[i] for i in positions], blocks[positions], level)

    # -- placement ---------------------------------------------------------------------------
    def _place(self, ids: list[int], blocks: Blocks, level: int) -> None:
        """Put new blocks into tier `level`; what does not fit goes one tier colder, oldest first."""
        room = self._make_room(level, len(ids))
        spill = len(ids) - room
        if spill:
            if level + 1 == len(self.tiers):
                raise CapacityError(f"{self.tiers[level].name} tier is full")
            self._place(ids[:spill], _rows(blocks, slice(0, spill)), level + 1)
        if room:
            self.tiers[level].put(ids[spill:], _rows(blocks, slice(spill, None)))
            self._record(ids[spill:], level)

    def _record(self, ids: Sequence[int], level: int) -> None:
        for block_id in ids:
            self.tier_of[block_id] = level
            self.order[level][block_id] = None

    def _make_room(self, level: int, n: int) -> int:
        """Cool victims out of tier `level` until n blocks fit; returns how many fit."""
        tier = self.tiers[level]
        deficit = n - tier.free_blocks()
        if deficit > 0 and level + 1 < len(self.tiers):
            victims = self.placement.victims(self.order[level], deficit, self._is_pinned, self._is_protected)
            for src_level, group in self._group_by_tier(victims).items():
                self._move(group, src_level, level + 1)
        return min(n, tier.free_blocks())

    def _move(self, ids: list[int], src: int, dst: int) -> None:
        """Move blocks one or more tiers colder; those that do not fit go colder still."""
        blocks = self.tiers[src].get(ids)
        self.tiers[src].delete(ids)
        for block_id in ids:
            del self.order[src][block_id]
        self._place(ids, blocks, dst)

    def _cool(self, table: LayerTable, old_tokens: int) -> None:
        """Demote blocks of `table` that left the hot or warm window."""
        crossed = self.placement.crossing(old_tokens, table.num_tokens, len(table.block_ids))
        wanted: dict[tuple[int, int], list[int]] = {}
        for index in crossed:
            block_id = table.block_ids[index]
            level = min(self.placement.level(index, table.num_tokens), COLD)
            if self.tier_of[block_id] < level:
                wanted.setdefault((self.tier_of[block_id], level), []).append(block_id)
        for (src, dst), ids in wanted.items():
            self._move(ids, src, dst)

    def _is_pinned(self, block_id: int) -> bool:
        """Tail blocks are written in place, so they never leave the hot tier."""
        seq, layer, index = self.owner[block_id]
        return index == len(self.sequences[seq][layer].block_ids) - 1

    def _is_protected(self, block_id: int) -> bool:
        seq, layer, index = self.owner[block_id]
        table = self.sequences[seq][layer]
        return self.placement.is_protected(index, len(table.block_ids), table.num_tokens)

    def _group_by_tier(self, ids: Sequence[int]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for block_id in ids:
            groups.setdefault(self.tier_of[block_id], []).append(block_id)
        return groups

    # -- read --------------------------------------------------------------------------------
    def read(self, seq: int, layer: int, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K, V [end - start, kv_heads, head_dim] fp16 on the store's device."""
        table = self._table(seq, layer)
        end = table.num_tokens if end is None else end
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= table.num_tokens):
            raise ValueError(f"need 0 <= start <= end <= {table.num_tokens}, got start={start!r} end={end!r}")
        b = self.config.block_tokens
        first, last = start // b, -(-end // b)
        blocks = self.gather(table.block_ids[first:last])  # [n, 2, H, B, D]
        kv = blocks.permute(1, 0, 3, 2, 4).reshape(2, -1, self.spec.num_kv_heads, self.spec.head_dim)
        kv = kv[:, start - first * b: end - first * b]
        return kv[0], kv[1]

    def gather(self, ids: Sequence[int]) -> torch.Tensor:
        """fp16 blocks [n, 2, H, B, D] on the store's device, from whichever tiers hold them."""
        out = self.layout.empty_fp16(len(ids), self.device)
        position = {block_id: i for i, block_id in enumerate(ids)}
        for level, group in self._group_by_tier(ids).items():
            tier = self.tiers[level]
            blocks = self.cpu.fetch(group, self.device) if tier is self.cpu else tier.get(group)
            blocks = blocks.to(self.device, non_blocking=True)
            if isinstance(blocks, Int8Blocks):
                blocks = dequantize(blocks)
            out[torch.tensor([position[i] for i in group], device=self.device)] = blocks
        return out

    def attend(self, seq: int, layer: int, q: torch.Tensor, mode: str = "dense", budget: int = 4096) -> torch.Tensor:
        """Decode attention of q [num_q_heads, head_dim] over one layer of `seq` (see kvstore.decode)."""
        return decode.attend(self, seq, layer, q, mode, budget)

    # -- introspection -----------------------------------------------------------------------
    def stats(self) -> dict:
        tiers = {name: {"blocks": t.num_blocks, "bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes}
                 for name, t in zip(TIER_NAMES, self.tiers)}
        tokens = sum(tables[0].num_tokens for tables in self.sequences.values())
        return {
            "tiers": tiers,
            "sequences": {"count": len(self.sequences), "tokens": tokens},
            "integrity_errors": sum(getattr(t, "integrity_errors", 0) for t in self.tiers),
        }

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant is broken."""
        for level, tier in enumerate(self.tiers):
            tier.check_integrity()
            if tier.num_blocks != len(self.order[level]) or any(i not in tier for i in self.order[level]):
                raise AssertionError(f"{tier.name}: {tier.num_blocks} blocks stored, {len(self.order[level])} recorded")
        if sum(len(o) for o in self.order) != len(self.tier_of) or len(self.tier_of) != len(self.owner):
            raise AssertionError("block records disagree: a block is in two tiers or in none")
        b = self.config.block_tokens
        for seq, tables in self.sequences.items():
            for layer, table in enumerate(tables):
                if len(table.block_ids) != -(-table.num_tokens // b):
                    raise AssertionError(f"seq {seq} layer {layer}: {len(table.block_ids)} blocks for {table.num_tokens} tokens")
                for index, block_id in enumerate(table.block_ids):
                    if self.owner.get(block_id) != (seq, layer, index):
                        raise AssertionError(f"seq {seq} layer {layer}: block {block_id} is not owned by its table")
                if table.block_ids and self.tier_of[table.block_ids[-1]] != 0:
                    raise AssertionError(f"seq {seq} layer {layer}: the tail block left the hot tier")

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
        if self._tempdir:
            shutil.rmtree(self._tempdir, ignore_errors=True)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rows(blocks: Blocks, rows: slice) -> Blocks:
    return blocks.index(rows) if isinstance(blocks, Int8Blocks) else blocks[rows]
