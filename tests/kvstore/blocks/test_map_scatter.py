"""One launch pointing entries of many tables at new slots, against its table-by-table reference (CPU under
TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from kvstore.blocks.map_scatter import scatter_locations, scatter_locations_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_scatter_matches_reference_over_tables_of_different_sizes():
    g = torch.Generator().manual_seed(4)
    sizes = [7, 300, 1, 45]
    maps = [(torch.randint(-1, 99, (n,), generator=g, dtype=torch.int32).to(DEVICE),
             torch.randint(0, 3, (n,), generator=g, dtype=torch.int8).to(DEVICE)) for n in sizes]
    want = [(s.clone(), t.clone()) for s, t in maps]
    indices = [[0, 6], sorted(torch.randperm(300, generator=g)[:40].tolist()), [], [44]]
    slots = [[5, 1000], list(range(40)), [], [2**31 - 1]]
    scatter_locations(maps, indices, slots, 2)
    scatter_locations_ref(want, indices, slots, 2)
    for (s, t), (ws, wt) in zip(maps, want):
        assert torch.equal(s, ws) and torch.equal(t, wt)
    assert maps[1][1][indices[1]].eq(2).all() and maps[3][0][44] == 2**31 - 1


def test_bad_arguments_change_nothing():
    slot_map, tier_map = torch.zeros(4, dtype=torch.int32, device=DEVICE), torch.zeros(4, dtype=torch.int8,
                                                                                        device=DEVICE)
    with pytest.raises(ValueError, match="past a table"):
        scatter_locations([(slot_map, tier_map)], [[4]], [[1]], 1)
    with pytest.raises(ValueError, match="one slot per entry"):
        scatter_locations([(slot_map, tier_map)], [[1, 2]], [[1]], 1)
    with pytest.raises(ValueError, match="int32 slot maps"):
        scatter_locations([(slot_map.long(), tier_map)], [[1]], [[1]], 1)
    assert not slot_map.any() and not tier_map.any()
