"""StepEviction: H2O drop mode (eviction/h2o.py) in a DecodeStep: every layer attends its live blocks, and the
least attended unprotected blocks are dropped for good once a layer holds more than the budget keeps.

The DecodePath (eager.py) decides per layer and token: after the token's append, drop what exceeds keep =
max(protected, budget // B) live blocks (`h2o_evict`), then attend every live block. The step makes the same
decision with the same function on the host between tokens (DecodeStep.open_token, after the new tail blocks
are placed, before the token's launch) and keeps each layer's live blocks where the captured step reads them:

    rows    int64 [L, k]  layer l's live block indices ascending (the tail last), then the tail again as padding
    count   int64 [1]     live blocks per layer, equal in every layer: the kernel reads the first `count` entries

Only a token that drops reads the H2O scores on the host (one read per layer that drops: at a block boundary,
or when the recent window's start moves past a block while the protected blocks set keep). The DecodePath seeds
a layer's all-zero scores with one extra attend before its first decision (a prefilled sequence has no mass
yet); the step leaves such a token to it (`ready` is False until every layer has scores).
"""

from __future__ import annotations

import torch

from eviction.h2o import H2O, h2o_evict
from eviction.select import SeqWindow
from kvstore.blocks.table import LayerTable
from kvstore.blocks.tierset import TierSet
from tiers.base import device_ints


class StepEviction:
    def __init__(self, policy: H2O, tables: list[LayerTable], tiers: TierSet, k: int, budget: int,
                 window: dict, device: torch.device) -> None:
        """window: block_tokens, sink_tokens and recent_tokens of the step's SeqWindow (the DecodePath's)."""
        self.policy, self.tables, self.tiers, self.k, self.budget = policy, tables, tiers, k, budget
        self.window = window
        self.rows = torch.zeros((len(tables), k), dtype=torch.int64, device=device)  # [L, k]
        self.count = torch.ones(1, dtype=torch.int64, device=device)  # [1]
        self.live: list[list[int]] = [[] for _ in tables]  # host copy of each layer's live indices
        self.num_live = 0  # what `count` holds
        self._seeded = False

    def ready(self) -> bool:
        """Whether the step can run the next token's decision: every layer as long as the others with as many live
        blocks (they grew and dropped together), and every layer's H2O scores seeded (one host read, until they
        are)."""
        first = self.tables[0]
        live = first.num_blocks - first.num_dropped
        if any(t.num_tokens != first.num_tokens or t.num_blocks - t.num_dropped != live for t in self.tables):
            return False
        if not self._seeded:
            seeded = [t.h2o_scores[:, : t.num_blocks].any() for t in self.tables if t.num_blocks]
            self._seeded = len(seeded) == len(self.tables) and bool(torch.stack(seeded).all())
        return self._seeded

    def update(self, num_tokens: int) -> None:
        """Host side, once the token's tail blocks are in place: num_tokens counts the token. Drops what exceeds
        the layer's keep, as the DecodePath would at this token, then writes the live rows and count if they
        changed."""
        window = SeqWindow(num_tokens=num_tokens, **self.window)
        keep = window.num_selected(self.budget)
        changed = False
        for layer, table in enumerate(self.tables):
            changed |= self._follow(layer, table)
            if len(self.live[layer]) > keep:
                dropped = torch.ones(table.num_blocks, dtype=torch.bool)  # the complement of the live list: a
                dropped[self.live[layer]] = False  # long sequence's thousands of dropped blocks, never listed
                evict = h2o_evict(table.h2o_scores[:, : table.num_blocks], window, keep_tokens=self.budget,
                                  dropped=dropped.nonzero().flatten(), head_reduce=self.policy.head_reduce)
                self.tiers.drop(table, evict)
                gone = set(evict)
                self.live[layer] = [i for i in self.live[layer] if i not in gone]
                changed = True
        if changed:
            rows = [live + live[-1:] * (self.k - len(live)) for live in self.live]
            self.rows.copy_(device_ints([i for row in rows for i in row], self.rows.device).view_as(self.rows))
            self.num_live = len(self.live[0])
            self.count.fill_(self.num_live)

    def _follow(self, layer: int, table: LayerTable) -> bool:
        """Bring the host's live list of `layer` up to its table: the new tail block added, or (after tokens that
        went the DecodePath's way, or a tail let go) rebuilt. Whether it changed."""
        live, n = self.live[layer], table.num_blocks
        if len(live) == n - table.num_dropped and (not live or live[-1] == n - 1):
            return False
        if len(live) == n - 1 - table.num_dropped and (not live or live[-1] == n - 2) and n:
            live.append(n - 1)
        else:
            self.live[layer] = table.live_indices()
        return True
