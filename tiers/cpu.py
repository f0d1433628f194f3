"""Cold CPU tier: host memory (pinned when CUDA exists), fp16 or a quantized format (tiers/quant.py), checksummed.

Memory comes in slabs allocated on first use, so a large `cpu_bytes` costs nothing
until blocks arrive, and `psutil` refuses a slab that would push free host memory
below the reserve (the store then spills to ssd instead of being OOM-killed).

Every block is verified on every read, against one checksum per slot kept in `sums`
(int64 [slots in slabs, 2]) on the tier's checksum device:
- beside a GPU (pinned slabs): block sums (tiers/block_checksum.py), computed on the GPU, per
  kv head too (`head_sums` [slots, H, 2], adding up to `sums`: a captured decode step reads and
  verifies one head's slice of a block, tiers/slice_gather.py). A block put from the GPU is
  summed there before it leaves it; one put from host memory (from ssd) is copied to the GPU to
  be summed. fetch(ids, gpu) gathers the rows of every slab in one launch that also sums them on
  their way (tiers/fetch_kernel.py), and compares the sums on the GPU: one host sync, no second
  pass over the rows. get() copies rows on the host, then the GPU sums the pinned result.
- host only: xxh3 on the host, (digest, 0) per slot, checked by worker threads (tiers/cpu_host.py);
  xxh3 runs at ~29 GB/s a core where block sums in torch run at 0.2-0.5 GB/s (block_checksum.py).
Device reads of slab rows a captured step queued (`reading_on_device`) finish before a put writes rows.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import psutil
import torch

from tiers.base import IntegrityError, PooledTier, SlotPool, block_checksums, check_ids
from tiers.block_checksum import block_sums, head_sums, sum_device
from tiers.block_rows import (byte_rows, copy_row_runs, copy_rows, device_of, fields, host_int64, int32_words,
                               normal_device, row_slice, to_device)
from tiers.cpu_host import HostRows
from tiers.fetch_kernel import SlabTable, add_slab, gather_slab_rows, slab_table
from tiers.layout import BlockLayout, Blocks
from tiers.quant import to_format

_SLAB_BYTES = 256 << 20


class CpuTier(HostRows, PooledTier):
    name = "cpu"

    def __init__(
        self, layout: BlockLayout, capacity_bytes: int, dtype: str = "float16",
        pin: bool | None = None, memory_reserve: int = 2 << 30, checksums: str = "auto",
    ) -> None:
        """checksums: "auto" (block sums on the current GPU when slabs are pinned, else "host"), "host"
        (xxh3 on the host), or the device that computes block sums ("cuda:0"; "cpu": the torch reference)."""
        self.layout = layout
        self.dtype = dtype
        self.block_bytes = layout.bytes_for(dtype)
        self.device = torch.device("cpu")
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.sum_device = sum_device(checksums, self.pin)  # None: xxh3 on the host
        self.memory_reserve = memory_reserve
        self.slots = SlotPool(self.name, capacity_bytes // self.block_bytes)
        self.slab_blocks = max(1, min(self.slots.num_slots, _SLAB_BYTES // self.block_bytes))
        self.slabs: list[Blocks] = []
        self._byte_views: list[list] = []  # per slab, numpy [rows, bytes] views of its tensors
        self._tables: dict[torch.device, SlabTable] = {}  # per reading device, built at its first fetch
        self.sums = torch.zeros((0, 2), dtype=torch.int64, device=self.sum_device or "cpu")  # [slots, 2]
        # with block sums, also per kv head (summing to sums): a captured decode step reads and verifies one
        # head's slice of a block (tiers/slice_gather.py)
        self.head_sums = torch.zeros((0, layout.num_kv_heads, 2), dtype=torch.int64, device=self.sums.device)
        self.generation = 0  # bumped whenever the checksum tables move (or the tier closes): captured graphs are stale
        self.integrity_errors = 0  # blocks found damaged by reads
        self._device_reads: torch.cuda.Event | None = None  # queued device reads of slab rows (a captured step)
        self._executor: ThreadPoolExecutor | None = None

    # -- memory --------------------------------------------------------------------------
    def _slabs_needed(self, n: int) -> int:
        """Slabs to allocate so that the n lowest free slots exist."""
        if n == 0:
            return 0
        highest = self.slots.lowest_free(n)[-1]
        return max(0, highest // self.slab_blocks + 1 - len(self.slabs))

    def can_put(self, n: int) -> bool:
        if not self.slots.can_allocate(n):
            return False
        new_bytes = self._slabs_needed(n) * self.slab_blocks * self.block_bytes
        return new_bytes == 0 or psutil.virtual_memory().available - new_bytes >= self.memory_reserve

    def free_blocks(self) -> int:
        """Free slots in existing slabs plus those in slabs host memory still allows."""
        allocated = len(self.slabs) * self.slab_blocks
        in_slabs = allocated - self.num_blocks  # used slots all lie in allocated slabs
        slab_bytes = self.slab_blocks * self.block_bytes
        spare = max(0, psutil.virtual_memory().available - self.memory_reserve) // slab_bytes
        return min(self.slots.num_free, in_slabs + spare * self.slab_blocks)

    def _grow_to(self, slot: int) -> None:
        """Slabs (and checksum rows) up to `slot`. A new slab joins the slab tables in place (room for every slab
        the tier may hold), so graphs captured over them stay valid; only the checksum tables, when they must
        reallocate (doubling: a few times in a tier's life), bump `generation`."""
        while len(self.slabs) <= slot // self.slab_blocks:
            self.slabs.append(self._empty(self.slab_blocks))
            self._byte_views.append([byte_rows(t) for t in fields(self.slabs[-1])])  # [rows, bytes] numpy views
            self._tables = {device: add_slab(table, [int32_words(f) for f in fields(self.slabs[-1])])
                            for device, table in self._tables.items()}
        if len(self.sums) < len(self.slabs) * self.slab_blocks:  # doubling: a huge tier copies it O(n) in all
            rows = max(len(self.slabs) * self.slab_blocks, 2 * len(self.sums))
            self.sums, self.head_sums = (torch.cat([t, t.new_zeros((rows - len(t), *t.shape[1:]))])
                                         for t in (self.sums, self.head_sums))
            self.generation += 1

    # -- protocol ------------------------------------------------------------------------
    def put(self, ids: Sequence[int], blocks: Blocks) -> None:
        self.layout.check(blocks)
        check_ids(ids, len(blocks), self.name)
        if not self.can_put(len(ids)):
            raise MemoryError(f"cpu tier: no room for {len(ids)} blocks (capacity or host memory reserve)")
        if not ids:
            return
        blocks = self._convert(blocks)
        sums = None
        if self.sum_device is not None:  # where the sums are kept; from the GPU, before the block leaves it
            sums = self._head_sums(blocks if device_of(blocks) == self.sum_device else blocks.to(self.sum_device))
        # From a GPU with the sums taken there, the rows go straight into the pinned slabs (a DMA per run of
        # consecutive slots); else through one host batch (xxh3 digests read it)
        direct = sums is not None and self.pin and device_of(blocks).type == "cuda"
        host = blocks if direct else blocks.to("cpu")
        if self._device_reads is not None:  # a slot freed since may still be read by queued work: let it finish
            self._device_reads.synchronize()
            self._device_reads = None
        slots = self.slots.allocate(ids)
        try:
            self._grow_to(max(slots))
            index, groups = self._plan(slots)
            for slab, cols in groups:
                (copy_row_runs if direct else copy_rows)(host, index[2, cols], self.slabs[slab], index[1, cols])
            if direct:  # the rows are the host's to read once put returns
                torch.cuda.current_stream(device_of(blocks)).synchronize()
            self._record_sums(host, slots, sums)
        except BaseException:
            self.slots.release(ids)
            raise

    def _record_sums(self, host: Blocks, slots: list[int], sums: torch.Tensor | None) -> None:
        if sums is None:
            self._digests()[slots] = block_checksums(host)
            return
        index = to_device(host_int64(slots), self.sum_device)
        self.head_sums[index] = sums
        self.sums[index] = sums.sum(dim=1)  # wraps mod 2^64, as block sums do

    def _head_sums(self, blocks: Blocks) -> torch.Tensor:
        """head_sums of `blocks` (on the sum device), in pieces of 64 blocks (its int64 copy is 2x a block)."""
        n = len(blocks)
        parts = [head_sums([f.contiguous() for f in fields(row_slice(blocks, lo, min(lo + 64, n)))],
                           self.layout.num_kv_heads) for lo in range(0, n, 64)]
        return torch.cat(parts) if parts else self.head_sums[:0]

    def reading_on_device(self, event: torch.cuda.Event) -> None:
        """Queued device work reads slab rows directly (tiers/slice_gather.py): `event` is recorded after it, and
        the next put waits for it before it writes rows (host copies are not ordered with the device's stream)."""
        event.record()
        self._device_reads = event

    def slab_table(self, device: torch.device) -> SlabTable:
        """The slabs as `device` reads them (built at its first use; extended in place as the slabs grow)."""
        device = normal_device(device)
        if device not in self._tables:
            self._tables[device] = slab_table([[int32_words(f) for f in fields(s)] for s in self.slabs], device,
                                              capacity=-(-self.slots.num_slots // self.slab_blocks))
        return self._tables[device]

    def get(self, ids: Sequence[int]) -> Blocks:
        """Gathers `ids` into one (pinned) batch, verifying every block's checksum."""
        out = self._empty(len(ids))
        slots = self._gather(ids, out, verify=self.sum_device is None)
        if self.sum_device is not None and len(ids):  # an empty batch is not pinned: nothing for the device to read
            self._check(ids, out, _slot_tensor(slots, self.sum_device))
        return out

    def fetch(self, ids: Sequence[int], device: torch.device | str) -> Blocks:
        """`get` straight into `device` memory, verified. From pinned slabs the device gathers the rows
        itself, every slab and field in one launch, and (block sums) sums them in the same launch and
        compares the sums on the device, or (xxh3) worker threads check the stored rows meanwhile.
        Damaged blocks raise: nothing is returned."""
        device = normal_device(device)
        if self.sum_device is not None and device == self.sum_device:
            out = self._empty(len(ids), device)
            slots = _slot_tensor(self.slots.lookup(ids), device)
            got = torch.zeros((len(ids), 2), dtype=torch.int64, device=device)  # [n, 2], the kernel adds into it
            self._gather_to(slots, out, got)
            self._compare(ids, got, slots)
            return out
        if device.type == "cpu" or self.sum_device is not None or not self.pin:
            blocks = self.get(ids)
            return blocks if device.type == "cpu" else blocks.to(device, non_blocking=True)
        out = self._empty(len(ids), device)
        slots = self.slots.lookup(ids)
        checks = [self._pool().submit(self._verify, ids, slots, lo, hi) for lo, hi in self._chunks(len(ids))]
        self._gather_to(_slot_tensor(slots, device), out)
        for check in checks:
            check.result()  # raises IntegrityError: the gathered copy is dropped, never returned
        # the device reads the rows the host checked: it must be done before a later put may reuse their slots
        torch.cuda.current_stream(device).synchronize()
        return out

    def _check(self, ids: Sequence[int], batch: Blocks, slots: torch.Tensor) -> None:
        """Block sums of `batch` (on the checksum device, or pinned host memory) against those recorded
        for `slots` (int64 on the checksum device); one host sync."""
        self._compare(ids, block_sums(fields(batch), device=self.sum_device), slots)

    def _compare(self, ids: Sequence[int], got: torch.Tensor, slots: torch.Tensor) -> None:
        """IntegrityError naming the blocks whose sums `got` (int64 [n, 2] on the checksum device) differ from
        those recorded for `slots`; one host sync (a second one only to name damaged blocks)."""
        differs = (got != self.sums.index_select(0, slots)).any(dim=1)  # [n]
        if not bool(differs.any()):
            return
        bad = differs.nonzero().flatten().tolist()
        self.integrity_errors += len(bad)
        more = f" (and {len(bad) - 1} more: {[ids[i] for i in bad[1:9]]})" if len(bad) > 1 else ""
        raise IntegrityError(f"cpu tier: block {ids[bad[0]]} failed its checksum{more}")

    def _gather_to(self, slots: torch.Tensor, out: Blocks, sums: torch.Tensor | None = None) -> None:
        """out[i] = the block in slots[i] (int64 on out's device), out's device reading the slab rows itself,
        every slab and field in one launch; with `sums` (int64 [n, 2] zeros) also each block's block sums."""
        if not len(slots):
            return
        gather_slab_rows(self.slab_table(device_of(out)), slots, [int32_words(f) for f in fields(out)], sums)

    def _plan(self, slots: list[int]) -> tuple[torch.Tensor, list[tuple[int, slice]]]:
        """index int64 [3, n]: row 0 the slot of each batch position; rows 1 and 2 the row in its slab and
        the batch position, grouped by slab; and [(slab, its columns of rows 1 and 2)]."""
        slot = host_int64(slots)
        slab_of = slot // self.slab_blocks
        order = torch.argsort(slab_of, stable=True)
        index = torch.stack([slot, slot[order] % self.slab_blocks, order])
        slabs, counts = torch.unique_consecutive(slab_of[order], return_counts=True)
        ends = counts.cumsum(0).tolist()
        return index, [(s, slice(end - c, end)) for s, c, end in zip(slabs.tolist(), counts.tolist(), ends)]

    def _empty(self, n: int, device: torch.device | str = "cpu") -> Blocks:
        return self.layout.empty(self.dtype, n, device, pin=self.pin and torch.device(device).type == "cpu")

    def check_integrity(self) -> None:
        self.slots.check()
        if len(self.sums) < len(self.slabs) * self.slab_blocks:
            raise AssertionError("cpu tier: the checksum table does not cover the slabs")

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
        self.slabs.clear()
        self._byte_views.clear()
        self._tables.clear()
        self.sums, self.head_sums = self.sums[:0], self.head_sums[:0]
        self.generation += 1

    def _convert(self, blocks: Blocks) -> Blocks:
        return to_format(blocks, self.dtype, self.layout.int4_group)


def _slot_tensor(slots: list[int], device: torch.device) -> torch.Tensor:
    """Slots as int64 [n] on `device`, queued without a host sync."""
    return to_device(host_int64(slots), device)
