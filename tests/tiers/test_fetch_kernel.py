"""The zero-copy row gather against index_select (CPU under TRITON_INTERPRET=1; pinned host -> GPU on CUDA)."""

from __future__ import annotations

import pytest
import torch

from tiers.fetch_kernel import gather_rows, gather_rows_ref

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("num_rows, words, picks", [(5, 7, [4, 0, 4]), (40, 3000, list(range(39, -1, -3))), (9, 4096, [8])])
def test_matches_index_select(num_rows, words, picks):
    src = torch.randint(-2**31, 2**31 - 1, (num_rows, words), dtype=torch.int32)
    device = "cuda" if CUDA else "cpu"
    if CUDA:
        src = src.pin_memory()
    rows = torch.tensor(picks, dtype=torch.int64, device=device)
    got = torch.full((len(picks), words), 7, dtype=torch.int32, device=device)
    gather_rows(src, rows, got)
    want = torch.empty_like(got)
    gather_rows_ref(src, rows, want)
    assert torch.equal(got.cpu(), want.cpu())


def test_bad_arguments_are_named():
    src = torch.zeros((4, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match="src"):
        gather_rows(src.float(), torch.zeros(1, dtype=torch.int64), torch.zeros((1, 8), dtype=torch.int32))
    with pytest.raises(ValueError, match="dst"):
        gather_rows(src, torch.zeros(2, dtype=torch.int64), torch.zeros((1, 8), dtype=torch.int32))
