"""StepReadiness: whether a DecodeStep's next token can run from device state, and what it cools (step.py).

A token runs from device state when every block it may read is on the GPU or servable in the cpu tier, the
sequence is within the step's capacity, and, at a block boundary, the GPU pools have room for a new tail
block per layer (made, when the step serves whatever cools, by cooling the coldest GPU blocks into a cpu tier
with room). Blocks beyond the cpu tier (ssd, remote, saved), a dense phase over cold blocks, too few staging
rows (staging_tokens < budget) or a cpu tier checksummed on the host (xxh3) cannot be served from device
state: `ready()` says so and callers use the eager path for that token (store.load brings saved blocks into
the cpu tier and the GPU pools). A token that moves blocks out of the hot or warm window cools them before
it runs (`cooling`, as store.append does); the step refuses it if that left a block it cannot serve. A step
cools ahead, right after the previous token's launch (`cool_ahead`, from DecodeStep.end_token): the moves queue
behind that token on the GPU, so it reads every block where it was, while the host work overlaps it; `cooling`
is then empty until the length or a table's device maps change.
"""

from __future__ import annotations

from typing import Sequence

from kvstore.blocks.table import LayerTable
from kvstore.blocks.tierset import TierSet
from kvstore.config import Config
from kvstore.decode.cold_slices import StepColdBlocks


class StepReadiness:
    """The questions a DecodeStep answers between tokens, handed the sequence's tables, the tier set, the step's
    cpu-block reader and its fixed sizes: capacity (blocks per table), k (blocks per kv head in topk) and mode."""

    def __init__(self, tables: list[LayerTable], tiers: TierSet, cold: StepColdBlocks, config: Config,
                 capacity: int, k: int, mode: str) -> None:
        self.tables, self.tiers, self.cold, self.config = tables, tiers, cold, config
        self.block_tokens = config.block_tokens
        self.capacity, self.k, self.mode = capacity, k, mode
        self._cooled: tuple[int, int] | None = None  # (length, table moves) when cooled ahead (mark_cooled)

    @property
    def length(self) -> int:
        return self.tables[0].num_tokens

    def phase(self, num_tokens: int) -> str:
        """The phase at num_tokens tokens: "dense" while the tables hold at most k blocks (or in mode dense),
        then "topk" (a selection of k blocks per kv head) for good; h2o reads its live blocks as a selection from
        the first token on."""
        if self.mode == "h2o":
            return "topk"
        return "dense" if self.mode == "dense" or -(-num_tokens // self.block_tokens) <= self.k else "topk"

    def ready(self) -> bool:
        """Whether the next token can run from device state: every block on the GPU or servable in the cpu
        tier (module docstring), room in capacity, and at a block boundary room for new tail blocks (has_room)."""
        at_boundary = self.length % self.block_tokens == 0
        if at_boundary and not self.has_room(len(self.tables)):
            return False
        return self.length + 1 <= self.capacity * self.block_tokens and self.cold_servable(self.length + 1) and \
            (self.mode == "h2o" or not any(t.num_dropped for t in self.tables))

    def has_room(self, num_blocks: int) -> bool:
        """Whether num_blocks new tail blocks fit: in free GPU pool rows, or, when this step serves cpu blocks
        (can_spill), by cooling the coldest GPU blocks into a cpu tier with room (TierSet.place, at open_token)."""
        tiers = self.tiers
        gpu = tiers.hot.free_blocks() + tiers.warm.free_blocks()
        return gpu >= num_blocks or (self.can_spill() and gpu + tiers.cpu.free_blocks() >= num_blocks)

    def can_spill(self) -> bool:
        """Whether this sequence's next token is served whichever of its blocks cool into the cpu tier: past
        its dense phase, with every cold block in a cpu tier the step reads itself."""
        return self.phase(self.length + 1) == "topk" and self.cold.servable(self.tables, self.k)

    def cold_servable(self, num_tokens: int) -> bool:
        """Whether the step serves the tables' cold blocks at num_tokens tokens (none, or all in a cpu tier the
        device reads and verifies, in the topk phase, with a staging row per selected block)."""
        if not any(t.num_cold for t in self.tables):
            return True
        return self.phase(num_tokens) == "topk" and self.cold.servable(self.tables, self.k)

    def cooling(self) -> list[tuple[LayerTable, int, int]]:
        """What the next token cools (TierSet.cool_tables): every layer's table growing by one token, when that
        moves some block out of the hot or warm window; else nothing."""
        n = self.length
        if not self._crosses_window(n) or self._cooled == (n, self._moves()):
            return []
        return [(table, n, n + 1) for table in self.tables]

    def mark_cooled(self) -> None:
        """What the next token cools has just been cooled (module docstring): `cooling` is empty until the length
        or a table's device maps change (a block moved meanwhile is weighed again)."""
        self._cooled = (self.length, self._moves())

    def _moves(self) -> int:
        return sum(t.moves for t in self.tables)

    def _crosses_window(self, old: int) -> bool:
        """Whether growing from old to old + 1 tokens moves some block out of the hot or warm window."""
        c, b = self.config, self.block_tokens
        return any((old + 1 - w) // b != (old - w) // b for w in (c.hot_tokens, c.hot_tokens + c.warm_tokens))


def cool_ahead(steps: Sequence[StepReadiness]) -> None:
    """Cool now what the next token of each sequence would cool before it runs (module docstring), in one move per
    pair of tiers for all of them (the sequences of a batch)."""
    cooling = [(r, grown) for r in steps if (grown := r.cooling())]
    if cooling:
        cooling[0][0].tiers.cool_tables([g for _, grown in cooling for g in grown])
        for r, _ in cooling:
            r.mark_cooled()
