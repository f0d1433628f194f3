"""The cpu tier's gather of scattered slab rows to given batch positions (dst_rows: one launch per slab, no
temporary) against index_copy (CPU under TRITON_INTERPRET=1; pinned host -> GPU on CUDA)."""

from __future__ import annotations

import pytest
import torch

from tiers.fetch_kernel import gather_rows, gather_rows_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_rows, words, picks, places, batch", [
    (5, 7, [4, 0], [2, 0], 3),
    (40, 3000, list(range(39, 0, -4)), list(range(0, 20, 2)), 21),
    (9, 2049, [8, 3, 3], [5, 1, 0], 6),
])
def test_scatter_matches_index_copy(num_rows, words, picks, places, batch):
    g = torch.Generator().manual_seed(words)
    src = torch.randint(-2**31, 2**31, (num_rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    if DEVICE == "cuda":
        src = src.pin_memory()
    rows = torch.tensor(picks, dtype=torch.int64, device=DEVICE)
    dst_rows = torch.tensor(places, dtype=torch.int64, device=DEVICE)
    got = torch.full((batch, words), 7, dtype=torch.int32, device=DEVICE)
    want = got.clone()
    gather_rows(src, rows, got, dst_rows)
    gather_rows_ref(src, rows, want, dst_rows)
    assert torch.equal(got.cpu(), want.cpu())
    untouched = [i for i in range(batch) if i not in places]
    assert bool((got[untouched] == 7).all())


def test_bad_scatter_arguments_are_named():
    src = torch.zeros((4, 8), dtype=torch.int32)
    rows = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="dst_rows"):
        gather_rows(src, rows, torch.zeros((3, 8), dtype=torch.int32), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="dst_rows"):
        gather_rows(src, rows, torch.zeros((3, 8), dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="dst"):
        gather_rows(src, rows, torch.zeros((1, 8), dtype=torch.int32), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="dst"):
        gather_rows(src, rows, torch.zeros((3, 8), dtype=torch.int32))  # without dst_rows: exactly n rows
