"""KVStore: the KV cache of many sequences as fixed-size blocks across four tiers."""

from __future__ import annotations

import shutil
import tempfile
from typing import Sequence

import torch

from kvstore import decode
from kvstore.config import Config
from kvstore.placement import COLD, HOT, WARM, Placement
from kvstore.moves import TierMoves
from kvstore.registry import BlockRegistry
from kvstore.table import DROPPED, LayerTable, TableTensors
from tiers.base import Tier
from tiers.cpu import CpuTier
from tiers.hot import HotTier
from tiers.layout import BlockLayout, Int8Blocks
from tiers.quant import dequantize
from tiers.ssd import SsdTier
from tiers.warm import WarmTier

TIER_NAMES = ("hot", "warm", "cpu", "ssd")


class CapacityError(RuntimeError):
    """Every tier is full: the append was refused and nothing changed."""


class KVStore(TierMoves):
    def __init__(self, config: Config) -> None:
        c = self.config = config
        self.spec = c.model
        self.device = torch.device(c.device)
        self.layout = BlockLayout.of(c.model, c.block_tokens)
        self.placement = Placement(c.block_tokens, c.sink_tokens, c.hot_tokens, c.warm_tokens)
        hot_bytes, warm_bytes = self._split_gpu_bytes()
        self._tempdir = None if c.ssd_path or c.remote_url else tempfile.mkdtemp(prefix="kvtier-ssd-")
        self.tiers: list[Tier] = [
            HotTier(self.layout, hot_bytes, self.device, staging_blocks=c.staging_tokens // c.block_tokens),
            WarmTier(self.layout, warm_bytes, self.device),
            CpuTier(self.layout, c.cpu_bytes, c.cpu_dtype, pin=self.device.type == "cuda",
                    memory_reserve=c.host_memory_reserve),
            self._open_cold_tier(),
        ]
        self.hot, self.warm, self.cpu, self.cold = self.tiers
        self.blocks = BlockRegistry(len(self.tiers))
        self.sequences: dict[int, list[LayerTable]] = {}
        self.tensors = TableTensors(c.model.num_kv_heads, c.model.head_dim, c.block_tokens, self.device)
        self.attend_stats = decode.AttendStats()
        self._next_sequence = 0

    # -- construction ------------------------------------------------------------------------
    def _split_gpu_bytes(self) -> tuple[int, int]:
        """Staging comes first; the rest is split between hot and warm in proportion to one sequence's windows."""
        c, lay, p = self.config, self.layout, self.placement
        hot_blocks = c.model.num_layers * (p.sink_blocks + -(-c.hot_tokens // c.block_tokens) + 1)
        warm_blocks = c.model.num_layers * (c.warm_tokens // c.block_tokens)
        hot_need, warm_need = hot_blocks * lay.fp16_bytes, warm_blocks * lay.int8_bytes
        pools = c.gpu_bytes - (c.staging_tokens // c.block_tokens) * lay.fp16_bytes
        if pools < hot_need:
            raise ValueError(
                f"gpu_bytes={c.gpu_bytes} is too small: one sequence needs {hot_need} bytes of hot blocks "
                f"(sinks + hot window + tail for {c.model.num_layers} layers at block_tokens={c.block_tokens}) "
                f"besides {c.gpu_bytes - pools} bytes of staging for {c.staging_tokens} staging_tokens"
            )
        hot_bytes = pools * hot_need // (hot_need + warm_need)
        return hot_bytes, pools - hot_bytes

    def _open_cold_tier(self) -> Tier:
        c = self.config
        if c.remote_url:
            from tiers.remote.tier import RemoteTier

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

    def table(self, seq: int, layer: int) -> LayerTable:
        if seq not in self.sequences:
            raise KeyError(f"unknown sequence {seq!r} (never created or already freed)")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.spec.num_layers}), got {layer!r}")
        return self.sequences[seq][layer]

    def free(self, seq: int) -> None:
        """Return every block of `seq` to its tier."""
        self.table(seq, 0)
        for table in self.sequences[seq]:
            self._delete([i for i in table.block_ids if i != DROPPED])
        del self.sequences[seq]

    def drop(self, seq: int, layer: int, indices: Sequence[int]) -> None:
        """Free blocks for good (H2O drop mode): they are never attended or read again."""
        table = self.table(seq, layer)
        ids = [table.block_ids[i] for i in indices]
        if DROPPED in ids or table.num_blocks - 1 in indices:
            raise ValueError("drop: a block was already dropped, or is the tail block")
        self._delete(ids)
        for i in indices:
            table.block_ids[i] = DROPPED
        table.num_dropped += len(indices)
        self.tensors.set_location(table, list(indices), [-1] * len(indices), DROPPED)

    def _delete(self, ids: Sequence[int]) -> None:
        for level, group in self.blocks.by_tier(ids).items():
            self.tiers[level].delete(group)
            self._account(group, level, -1)
        self.blocks.remove(ids)

    # -- append ------------------------------------------------------------------------------
    def append(self, seq: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append k, v [T, kv_heads, head_dim] (fp16, on the store's device) to one layer."""
        table = self.table(seq, layer)
        self._check_kv(k, v)
        b = self.config.block_tokens
        fill = (-table.num_tokens) % b if table.block_ids else 0  # room left in the tail block
        head = min(fill, k.shape[0])
        num_new = -(-(k.shape[0] - head) // b)
        if num_new:
            self._check_room(num_new)
        old_tokens = table.num_tokens
        if head:
            tail = table.num_blocks - 1
            self.hot.write_tokens(table.block_ids[tail], b - fill, k[:head], v[:head])
            self.tensors.extend_tail(table, tail, k[:head])
            table.num_tokens += head
        if num_new:
            self._append_blocks(seq, layer, table, k[head:], v[head:])
        self._cool(table, old_tokens)

    def _check_room(self, num_new: int) -> None:
        """Refuse, before changing anything, an append the tiers cannot hold."""
        if num_new > sum(t.free_blocks() for t in self.tiers):
            raise CapacityError(f"no room for {num_new} more blocks in any tier (stats: {self.stats()['tiers']})")
        if not self.hot.free_blocks() and all(self._is_pinned(b) for b in self.blocks.oldest(HOT)):
            raise CapacityError(
                f"the hot pool's {self.hot.slots.num_slots} slots all hold tail blocks of live sequences; "
                "free a sequence or give the store more gpu_bytes"
            )

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
        b, t = self.config.block_tokens, k.shape[0]
        n, full = -(-t // b), t // b
        blocks = torch.zeros((n, 2, self.spec.num_kv_heads, b, self.spec.head_dim),
                             dtype=torch.float16, device=self.device)  # [n, 2, H, B, D]
        kv = torch.stack([k, v])  # [2, T, H, D]
        blocks[:full] = kv[:, :full * b].reshape(2, full, b, *k.shape[1:]).permute(1, 0, 3, 2, 4)
        if full < n:
            blocks[-1, :, :, : t - full * b] = kv[:, full * b:].transpose(1, 2)
        first = table.num_blocks
        ids = self.blocks.new_ids(n, seq, layer, first)
        self.tensors.write_new(table, first, k)
        table.block_ids.extend(ids)
        table.num_tokens += t
        levels = [self.placement.level(first + i, table.num_tokens) for i in range(n)]
        for level in (HOT, WARM, COLD):
            positions = [i for i, lv in enumerate(levels) if lv == level]
            if positions:
                self._place([ids[i] for i in positions], blocks[positions], level)

    # -- read --------------------------------------------------------------------------------
    def read(self, seq: int, layer: int, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K, V [end - start, kv_heads, head_dim] fp16 on the store's device."""
        table = self.table(seq, layer)
        end = table.num_tokens if end is None else end
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= table.num_tokens):
            raise ValueError(f"need 0 <= start <= end <= {table.num_tokens}, got start={start!r} end={end!r}")
        b = self.config.block_tokens
        first, last = start // b, -(-end // b)
        ids = table.block_ids[first:last]
        if DROPPED in ids:
            raise ValueError(f"tokens [{start}, {end}) of sequence {seq} layer {layer} include blocks H2O dropped")
        blocks = self.gather(ids)  # [n, 2, H, B, D]
        kv = blocks.permute(1, 0, 3, 2, 4).reshape(2, -1, self.spec.num_kv_heads, self.spec.head_dim)
        kv = kv[:, start - first * b: end - first * b]
        return kv[0], kv[1]

    def gather(self, ids: Sequence[int]) -> torch.Tensor:
        """fp16 blocks [n, 2, H, B, D] on the store's device, from whichever tiers hold them."""
        out = self.layout.empty_fp16(len(ids), self.device)
        position = {block_id: i for i, block_id in enumerate(ids)}
        for level, group in self.blocks.by_tier(ids).items():
            tier = self.tiers[level]
            blocks = self.cpu.fetch(group, self.device) if tier is self.cpu else tier.get(group)
            blocks = blocks.to(self.device, non_blocking=True)
            if isinstance(blocks, Int8Blocks):
                blocks = dequantize(blocks)
            out[torch.tensor([position[i] for i in group], device=self.device)] = blocks
        return out

    def attend(self, seq: int, layer: int, q: torch.Tensor, mode: str = "dense", budget: int = 4096,
               measure_mass: bool = False) -> torch.Tensor:
        """Decode attention of q [num_q_heads, head_dim] over one layer of `seq` (see kvstore.decode)."""
        return decode.attend(self, seq, layer, q, mode, budget, measure_mass)

    # -- introspection -----------------------------------------------------------------------
    def stats(self) -> dict:
        tiers = {name: {"blocks": t.num_blocks, "bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes}
                 for name, t in zip(TIER_NAMES, self.tiers)}
        if self.cold.name == "remote":  # cold blocks live in a sidecar, not on a local disk
            tiers["remote"] = tiers.pop("ssd")
        tokens = sum(tables[0].num_tokens for tables in self.sequences.values())
        return {
            "tiers": tiers,
            "sequences": {"count": len(self.sequences), "tokens": tokens},
            "integrity_errors": sum(getattr(t, "integrity_errors", 0) for t in self.tiers),
            "attend": self.attend_stats.as_dict(),
        }

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant is broken."""
        for tier in self.tiers:
            tier.check_integrity()
        self.blocks.check(self.tiers)
        for seq, tables in self.sequences.items():
            for layer, table in enumerate(tables):
                self._check_table(seq, layer, table)

    def _check_table(self, seq: int, layer: int, table: LayerTable) -> None:
        where = f"seq {seq} layer {layer}"
        if table.num_blocks != -(-table.num_tokens // self.config.block_tokens):
            raise AssertionError(f"{where}: {table.num_blocks} blocks for {table.num_tokens} tokens")
        live = [(i, b) for i, b in enumerate(table.block_ids) if b != DROPPED]
        if any(self.blocks.owner.get(b) != (seq, layer, i) for i, b in live):
            raise AssertionError(f"{where}: a block is not owned by its table")
        levels = [self.blocks.tier_of[b] for _, b in live]
        counts = (sum(lv == WARM for lv in levels), sum(lv >= COLD for lv in levels), table.block_ids.count(DROPPED))
        if counts != (table.num_warm, table.num_cold, table.num_dropped):
            raise AssertionError(f"{where}: warm/cold/dropped counts {counts} are stale")
        if table.block_ids and levels and self.blocks.tier_of.get(table.block_ids[-1]) != HOT:
            raise AssertionError(f"{where}: the tail block left the hot tier")
        if table.num_blocks:
            want = [-1] * table.num_blocks
            for (i, _), lv in zip(live, levels):
                want[i] = lv
            if table.level_map[: table.num_blocks].tolist() != want:
                raise AssertionError(f"{where}: the device level map disagrees with the registry")

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
        if self._tempdir:
            shutil.rmtree(self._tempdir, ignore_errors=True)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
