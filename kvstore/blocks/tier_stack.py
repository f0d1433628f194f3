"""The tier stack a Config describes: which tiers a store has, how big each one is, and their lifetime.

    0 hot   GPU fp16 pool + staging rows     1 warm  GPU quantized pool (Config.warm_format) + staging rows (the GPU budget split
                                                      between them; staging_tokens of staging in each)
    2 cpu   host memory, pinned on CUDA      3 cold  the sidecar, Redis, or LMDB at ssd_path
    4 saved read-only: blocks of opened saved contexts, read where the save put them
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Iterator

import torch

from kvstore.config import Config
from kvstore.blocks.placement import Placement
from tiers.base import Tier
from tiers.cpu import CpuTier
from tiers.hot import HotTier
from tiers.layout import BlockLayout
from tiers.saved import SavedTier
from tiers.saved_values import LmdbValues
from tiers.ssd import SsdTier
from tiers.warm import WarmTier

HOT_TIER, WARM_TIER, CPU_TIER, COLD_TIER, SAVED_TIER = 0, 1, 2, 3, 4


class TierStack:
    """The tiers in index order, what they report together, and the temporary directory an ssd tier
    without an ssd_path lives in (removed on close)."""

    def __init__(self, c: Config, layout: BlockLayout, placement: Placement) -> None:
        self._tempdir = None if c.ssd_path or c.remote_url or c.redis_url else tempfile.mkdtemp(prefix="kvtier-ssd-")
        try:
            self.tiers: list[Tier] = open_tiers(c, layout, placement, self._tempdir)
        except BaseException:  # a stack that never opened leaves no directory behind
            if self._tempdir:
                shutil.rmtree(self._tempdir, ignore_errors=True)
            raise

    def __iter__(self) -> Iterator[Tier]:
        return iter(self.tiers)

    def __getitem__(self, index: int | slice) -> Tier | list[Tier]:
        return self.tiers[index]

    def __len__(self) -> int:
        return len(self.tiers)

    def free_blocks(self) -> int:
        return sum(t.free_blocks() for t in self.tiers)

    def stats(self) -> dict:
        return {t.name: {"blocks": t.num_blocks, "bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes}
                for t in self.tiers}

    @property
    def integrity_errors(self) -> int:
        return sum(getattr(t, "integrity_errors", 0) for t in self.tiers)

    @property
    def missing_blocks(self) -> int:
        """Blocks a shared tier no longer held when asked (a Redis eviction): BlockMissingError each time."""
        return sum(getattr(t, "missing_blocks", 0) for t in self.tiers)

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
        if self._tempdir:
            shutil.rmtree(self._tempdir, ignore_errors=True)


def open_tiers(c: Config, layout: BlockLayout, placement: Placement, tempdir: str | None) -> list[Tier]:
    """[hot, warm, cpu, cold, saved], in the order of the tier indices."""
    device = torch.device(c.device)
    hot_bytes, warm_bytes = split_gpu_bytes(c, layout, placement)
    cold = open_cold_tier(c, layout, tempdir)
    return [
        HotTier(layout, hot_bytes, device, staging_blocks=c.staging_tokens // c.block_tokens),
        WarmTier(layout, warm_bytes, device, staging_blocks=c.staging_tokens // c.block_tokens),
        CpuTier(layout, c.cpu_bytes, c.cpu_dtype, pin=device.type == "cuda", memory_reserve=c.host_memory_reserve,
                checksums=c.cpu_checksums),
        cold,
        SavedTier(layout, LmdbValues(cold.env) if isinstance(cold, SsdTier) else None),
    ]


def staging_bytes(layout: BlockLayout, staging_tokens: int) -> int:
    """GPU bytes that `staging_tokens` of staging take: as many rows in the hot (fp16) and warm pools."""
    return staging_tokens // layout.block_tokens * (layout.fp16_bytes + layout.warm_bytes)


def split_gpu_bytes(c: Config, layout: BlockLayout, p: Placement) -> tuple[int, int]:
    """(hot, warm) bytes: staging comes first; the rest is split in proportion to one sequence's windows, the
    hot pool holding at least the sinks, hot windows and tails of hot_sequences sequences (sequences decoded
    together open their tails at once: with fewer rows, room for them is made by cooling protected blocks)."""
    hot_blocks = c.model.num_layers * (p.sink_blocks + -(-c.hot_tokens // c.block_tokens) + 1)
    warm_blocks = c.model.num_layers * (c.warm_tokens // c.block_tokens)
    hot_need, warm_need = hot_blocks * layout.fp16_bytes, warm_blocks * layout.warm_bytes
    pools = c.gpu_bytes - staging_bytes(layout, c.staging_tokens)
    if pools < hot_need * c.hot_sequences:
        raise ValueError(
            f"gpu_bytes={c.gpu_bytes} is too small: {c.hot_sequences} sequence(s) need {hot_need} bytes each of "
            f"hot blocks (sinks + hot window + tail for {c.model.num_layers} layers at block_tokens="
            f"{c.block_tokens}) besides {c.gpu_bytes - pools} bytes of staging for {c.staging_tokens} staging_tokens"
        )
    hot_bytes = max(hot_need * c.hot_sequences, pools * hot_need // (hot_need + warm_need))  # warm never starves hot
    return hot_bytes, pools - hot_bytes


def open_cold_tier(c: Config, layout: BlockLayout, tempdir: str | None) -> Tier:
    """The coldest tier: the sidecar (remote_url), Redis (redis_url), else local LMDB at ssd_path
    (or a temporary directory)."""
    if c.remote_url:
        from tiers.remote.tier import RemoteTier

        return RemoteTier(layout, c.remote_url, c.ssd_bytes, token=c.remote_token)
    if c.redis_url:
        from tiers.redis import RedisTier

        return RedisTier(layout, c.redis_url, c.ssd_bytes, namespace=c.redis_namespace,
                         compression=c.redis_compression)
    ssd = SsdTier(layout, c.ssd_path or tempdir, c.ssd_bytes, c.ssd_compression, c.ssd_level, sync=False,
                  key_prefix=b"kvstore/")
    stale = list(ssd.sizes)  # blocks of an earlier store on this path: no table points at them
    if stale:
        ssd.delete_keys(stale)
    return ssd
