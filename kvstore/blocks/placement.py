"""Where each block should live: the windows that keep blocks hot or warm, and the
victims that cool first when a shared pool is full.

Levels: 0 hot (GPU fp16), 1 warm (GPU int8), 2 cold (cpu, then ssd or the sidecar).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

HOT, WARM, COLD = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Placement:
    block_tokens: int
    sink_tokens: int
    hot_tokens: int
    warm_tokens: int

    @property
    def sink_blocks(self) -> int:
        return -(-self.sink_tokens // self.block_tokens)

    def level(self, index: int, num_tokens: int) -> int:
        """The level block `index` belongs to in a sequence of `num_tokens` tokens."""
        block_end = (index + 1) * self.block_tokens
        if index < self.sink_blocks or block_end > num_tokens - self.hot_tokens:
            return HOT
        if block_end > num_tokens - self.hot_tokens - self.warm_tokens:
            return WARM
        return COLD

    def crossing(self, old_tokens: int, new_tokens: int, num_old_blocks: int) -> list[int]:
        """Old blocks whose level drops when the sequence grows from old_tokens to new_tokens."""
        changed: set[int] = set()
        # A block leaves a window when its end passes the window's start: two narrow ranges.
        for window in (self.hot_tokens, self.hot_tokens + self.warm_tokens):
            first = max(self.sink_blocks, (old_tokens - window) // self.block_tokens - 1)
            last = min(num_old_blocks, (new_tokens - window) // self.block_tokens + 1)
            changed.update(i for i in range(first, last) if self.level(i, new_tokens) > self.level(i, old_tokens))
        return sorted(changed)

    def is_protected(self, index: int, num_blocks: int, num_tokens: int) -> bool:
        """Sinks and the recent hot window: cooled early only when nothing else is left."""
        return self.level(index, num_tokens) == HOT or index == num_blocks - 1

    @staticmethod
    def victims(order: Iterable[int], n: int, is_pinned: Callable[[int], bool],
                is_protected: Callable[[int], bool]) -> list[int]:
        """Up to n blocks to cool, oldest first: unprotected ones, then protected; never pinned."""
        chosen: list[int] = []
        fallback: list[int] = []
        for block_id in order:
            if is_pinned(block_id):
                continue
            if is_protected(block_id):
                if len(fallback) < n:
                    fallback.append(block_id)
                continue
            chosen.append(block_id)
            if len(chosen) == n:
                return chosen
        return chosen + fallback[: n - len(chosen)]
