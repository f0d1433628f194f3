"""The captured decode step's cpu-tier blocks (kvstore/decode/step.py): whether it can serve them, staging the slices
it selects and verifying them (the blocks it keeps reading move up to the warm tier: promotion.py).

Staging (tiers/slice_gather.py): inside the step, each selected cpu block's kv-head slice is read from the
pinned slab into a staging row of the GPU pool of the cpu tier's format and verified on the device against
the head's recorded sums; damage is counted on the device and `verify` raises IntegrityError at the next
sync. The same launch counts, per layer and table position, the slices it read (`reads`), which the
step's promotion reads at block boundaries.
"""

from __future__ import annotations

import torch

from kvstore.blocks.table import LayerTable
from kvstore.blocks.tierset import CPU_TIER, TierSet
from kvstore.config import ModelSpec
from kvstore.decode.eager import AttendStats
from tiers.base import IntegrityError
from tiers.block_rows import fields, normal_device
from tiers.slice_gather import stage_cold_slices


class StepColdBlocks:
    def __init__(self, tiers: TierSet, stats: AttendStats, device: torch.device, spec: ModelSpec,
                 capacity: int) -> None:
        dev = self.device = device
        self.tiers, self.stats, self.num_kv_heads = tiers, stats, spec.num_kv_heads
        num_layers = spec.num_layers
        self.counts = torch.zeros(2, dtype=torch.int64, device=dev)  # damaged and staged slices, summed
        self._seen = [0, 0]  # counts as verify() last read them
        self.unverified = False  # a token staged cold blocks since verify() last read counts
        self.reads = torch.zeros((num_layers, capacity), dtype=torch.int32, device=dev)  # slices staged per block
        self.staged_since_boundary = False  # a token staged slices since promotion last read `reads`
        self.row_offset = 0  # this step's staging rows start here: each sequence of a batch has rows of its own

    def staging_pool(self):
        """The GPU tier whose staging rows take cpu blocks: the warm (quantized) or hot (fp16) one, as the cpu tier
        holds (a quantized cpu tier holds the warm format: Config)."""
        tiers = self.tiers
        return tiers.hot if tiers.cpu.dtype == "float16" else tiers.warm

    def servable(self, tables: list[LayerTable], k: int) -> bool:
        """Whether the tables' cold blocks all lie in a cpu tier the step's device verifies, with a staging row
        for each of k selected blocks (the phase is the step's to check)."""
        cpu = self.tiers.cpu
        return not any(t.num_far for t in tables) and cpu.sum_device == normal_device(self.device) and \
            self.staging_pool().staging_blocks >= self.row_offset + k

    def stage(self, layer: int, table: LayerTable, selected: torch.Tensor, slots: torch.Tensor,
              is_int8: torch.Tensor) -> None:
        """Device side: the cpu blocks among `selected` [H, k] staged into the kernel's block table (slots, is_int8)."""
        cpu, pool = self.tiers.cpu, self.staging_pool()
        stage_cold_slices(selected, table.tier_map, table.slot_map, slots, is_int8,
                          cpu.slab_table(self.device), cpu.head_sums, fields(pool.pool),
                          pool.slots.num_slots + self.row_offset, CPU_TIER, self.counts, self.reads[layer])

    def token_done(self, staged: bool) -> None:
        """After a token's device work is queued: what it staged is to be verified; pinned rows it reads stay put."""
        self.unverified |= staged
        self.staged_since_boundary |= staged
        if staged and self.device.type == "cuda":  # the GPU may still be reading pinned rows: no put
            self.tiers.cpu.reading_on_device(torch.cuda.Event())  # may overwrite a slot freed meanwhile

    def verify(self) -> None:
        """IntegrityError if a slice staged since the last call failed its checksum (one host sync; nothing to
        read when no token staged cold blocks)."""
        if not self.unverified:
            return
        damaged, staged = self.counts.tolist()
        new_damage = damaged - self._seen[0]
        self.stats.cold_slices_staged += staged - self._seen[1]
        self._seen, self.unverified = [damaged, staged], False
        if new_damage:
            self.tiers.cpu.integrity_errors += new_damage
            raise IntegrityError(f"cpu tier: {new_damage} block slices read by the captured decode step failed "
                                 f"their checksums; the tokens since the last verified one are not to be trusted")
