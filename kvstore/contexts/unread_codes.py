"""Sketch codes that stay in a saved context until the sketch policy first needs them.

Opening a saved context reads its key summaries, not its sketch codes (kvstore/contexts/saving.py): each
layer's table rows are marked unread, pointing at their rows of the codes in the save. The marks
travel with the rows: a fork carries its original's, a sequence started on a prefix carries those
of the rows it shares, and a save of any of them copies the unread codes from the saved values
into the new save (through host memory, never into the table). `load_if_needed` reads a sequence's
codes into its tables once, when the sketch policy is about to read them. A save replacing the one a
piece reads keeps that one's data while a piece holds its reader (SavedReader.code_readers), so
pieces are dropped as soon as their rows are read or their sequence is freed.

A saved partial tail that has filled since was re-encoded on its final grid (AppendPath, DecodeStep)
and keeps those codes: its mark lapses once the table holds the whole block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvstore.blocks.table import LayerTable

ReadCodes = Callable[[int, int], torch.Tensor]  # (lo, hi) -> uint8 [hi - lo, H, 2, B, D/4]: saved rows, on the CPU


@dataclass(frozen=True, slots=True)
class Unread:
    """Table rows `dst` hold no codes yet: theirs are rows `src` of what `read` reads."""

    read: ReadCodes
    src: torch.Tensor  # int64 [m] rows of the saved codes
    dst: torch.Tensor  # int64 [m] rows of the table
    tail: int = -1  # the dst row of a saved partial tail (-1: none)

    def rows(self, table: LayerTable, block_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) of the rows still unread in `table`."""
        if 0 <= self.tail and table.num_tokens >= (self.tail + 1) * block_tokens:  # the tail filled since
            keep = self.dst != self.tail
            return self.src[keep], self.dst[keep]
        return self.src, self.dst

    def codes(self, src: torch.Tensor) -> torch.Tensor:
        """uint8 [len(src), H, 2, B, D/4]: saved rows `src`, reading only the span they cover."""
        lo = int(src.min())
        return self.read(lo, int(src.max()) + 1)[src - lo]


class UnreadCodes:
    """Per sequence and layer, the table rows whose sketch codes are still in a saved context."""

    def __init__(self, tables: dict[int, list[LayerTable]], block_tokens: int, device: torch.device) -> None:
        self.tables, self.block_tokens, self.device = tables, block_tokens, device
        self.unread: dict[int, list[list[Unread]]] = {}  # sequence -> per layer, its unread rows

    def __contains__(self, seq: int) -> bool:
        return seq in self.unread

    def opened(self, seq: int, layers: list[tuple[ReadCodes, int, bool]]) -> None:
        """Every row of `seq` is unread: per layer (read, number of saved blocks, whether the last is partial)."""
        self.unread[seq] = [[Unread(read, torch.arange(n), torch.arange(n), n - 1 if partial else -1)] if n else []
                            for read, n, partial in layers]

    def fork(self, seq: int, new: int) -> None:
        """`new` is a copy of `seq`'s tables: its codes are as unread as the original's."""
        if seq in self.unread:
            self.unread[new] = [list(pieces) for pieces in self.unread[seq]]

    def carry(self, seq: int, layer: int, src: list[int], new: int, dst: list[int]) -> None:
        """Rows `dst` of (new, layer) are copies of rows `src` of (seq, layer): those unread stay unread."""
        if seq not in self.unread:
            return
        table, src_rows, dst_rows = self.tables[seq][layer], torch.tensor(src, dtype=torch.int64), \
            torch.tensor(dst, dtype=torch.int64)
        for piece in self.unread[seq][layer]:
            saved_src, saved_dst = piece.rows(table, self.block_tokens)
            saved_row = torch.full((table.num_blocks,), -1, dtype=torch.int64)
            saved_row[saved_dst] = saved_src
            rows = saved_row[src_rows]
            moved = rows >= 0
            if moved.any():
                layers = self.unread.setdefault(new, [[] for _ in self.tables[seq]])
                layers[layer].append(Unread(piece.read, rows[moved], dst_rows[moved]))

    def load_if_needed(self, seq: int) -> None:
        """Read the unread codes of `seq` into its tables (once; a failure part way keeps the rows done)."""
        layers = self.unread.get(seq)
        if layers is None:
            return
        for layer, pieces in enumerate(layers):
            table = self.tables[seq][layer]
            while pieces:
                src, dst = pieces[0].rows(table, self.block_tokens)
                if len(src):
                    table.sketch[dst.to(self.device)] = pieces[0].codes(src).to(self.device)
                pieces.pop(0)
        del self.unread[seq]

    def codes(self, seq: int, layer: int, lo: int, hi: int) -> torch.Tensor:
        """uint8 [hi - lo, H, 2, B, D/4] on the CPU: the codes of rows [lo, hi) of (seq, layer) as a save
        writes them, the unread ones read from their saved context (the table is left as it is)."""
        table = self.tables[seq][layer]
        out = table.sketch[lo:hi].to("cpu", copy=True)
        for piece in self.unread[seq][layer] if seq in self.unread else ():
            src, dst = piece.rows(table, self.block_tokens)
            inside = (dst >= lo) & (dst < hi)
            if inside.any():
                out[dst[inside] - lo] = piece.codes(src[inside])
        return out

    def forget(self, seq: int) -> None:
        self.unread.pop(seq, None)
