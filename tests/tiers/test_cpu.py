"""The cpu tier: checksums on every read, chunked parallel gathers, the host-memory guard."""

from __future__ import annotations

import pytest
import torch

from tiers.base import IntegrityError
from tiers.cpu import CpuTier
from tiers.layout import BlockLayout

LAYOUT = BlockLayout(num_kv_heads=2, block_tokens=64, head_dim=64)  # 32 KiB blocks


def blocks(n: int, seed: int) -> torch.Tensor:
    return torch.randn((n, *LAYOUT.shape), generator=torch.Generator().manual_seed(seed)).half()


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_corrupted_host_memory_is_detected(dtype):
    tier = CpuTier(LAYOUT, 64 * LAYOUT.fp16_bytes, dtype=dtype, memory_reserve=0)
    tier.put([1, 2, 3], blocks(3, seed=1))
    slab = tier.slabs[0] if dtype == "float16" else tier.slabs[0].data
    row_bytes = slab[0].numel() * slab.element_size()
    slab.view(torch.uint8).view(-1)[row_bytes + 17] ^= 1  # a bit flip in block 2's slot (slot 1)
    with pytest.raises(IntegrityError, match="block 2"):
        tier.get([1, 2, 3])
    # The GPU fetch path verifies stored rows in place (no gather first): same verdict.
    with pytest.raises(IntegrityError, match="block 2"):
        tier._verify([1, 2, 3], tier.slots.lookup([1, 2, 3]), 0, 3)
    assert tier.integrity_errors == 2
    tier.get([1, 3])  # intact blocks still read
    tier._verify([1, 3], tier.slots.lookup([1, 3]), 0, 2)


def test_large_gathers_run_in_verified_chunks():
    n = 700  # > one 8 MiB chunk of 32 KiB blocks
    tier = CpuTier(LAYOUT, 1024 * LAYOUT.fp16_bytes, memory_reserve=0)
    x = blocks(n, seed=2)
    tier.put(list(range(n)), x)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
    assert torch.equal(tier.get(order), x[order])
    assert torch.equal(tier.fetch(order, "cpu"), x[order])
    tier.close()


def test_host_memory_guard_refuses_instead_of_oom():
    huge_reserve = 1 << 60  # more than any machine has: no new slab may be allocated
    tier = CpuTier(LAYOUT, 8 * LAYOUT.fp16_bytes, memory_reserve=huge_reserve)
    assert tier.free_blocks() == 0 and not tier.can_put(1)
    with pytest.raises(MemoryError, match="host memory"):
        tier.put([1], blocks(1, seed=4))
    assert tier.num_blocks == 0
