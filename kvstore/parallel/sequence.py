"""ShardedSequence: one sequence whose blocks are split over ranks, each rank's shard in its own KVStore.

Every rank makes the same calls in the same order (fill, append, attend for each layer); each keeps only its
ShardPlan range of the K/V and attends only over it:

    1. select   dense: the whole shard. topk / sketch: the shard's protected blocks (the sequence's sinks and
                recent window, where they fall in it) plus as many more as the budget rule gives the rank
                (shards.py; one all_gather of [kv heads, k_free] bounds), chosen by the mode's policy
    2. attend   the store's paged kernel over the selection: partial output [Hq, D] and log-sum-exp [Hq]
    3. merge    all_gather of [Hq, D + 1] per rank, merged by log-sum-exp (merge.py) on every rank alike
    4. account  the rank's block mass, scaled by its share of the softmax, into its H2O scores (DecodePath.account)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eviction.select import SeqWindow, all_blocks
from kvstore.blocks.table import LayerTable
from kvstore.parallel.group import RankGroup
from kvstore.parallel.merge import merge_partials, rank_weights
from kvstore.parallel.shards import (ShardPlan, allot_free_blocks, free_to_select, free_top, select_shard,
                                     shard_scores)
from kvstore.store import KVStore

MODES = ("dense", "topk", "sketch")


class ShardedSequence:
    """This rank's part of one sequence sharded by `plan` over `group`."""

    def __init__(self, store: KVStore, group: RankGroup, plan: ShardPlan, seq: int | None = None,
                 lengths: Sequence[int] | None = None) -> None:
        """A new, empty sequence; or (seq and lengths: the whole sequence's tokens per layer) one of the store's
        sequences that holds exactly this rank's range of them, e.g. a shard opened from a save."""
        if plan.world_size != group.world_size:
            raise ValueError(f"plan has {plan.world_size} ranks, the group {group.world_size}")
        if plan.block_tokens != store.config.block_tokens:
            raise ValueError(f"plan's blocks are {plan.block_tokens} tokens, the store's {store.config.block_tokens}")
        if (seq is None) != (lengths is None):
            raise ValueError("pass both seq and lengths (an existing shard) or neither (a new sequence)")
        self.store, self.group, self.plan = store, group, plan
        self.rank = group.rank
        self.lo, self.hi = plan.token_range(self.rank)
        num_layers = store.spec.num_layers
        self.lengths = [0] * num_layers if lengths is None else list(lengths)  # whole sequence's tokens, per layer
        if len(self.lengths) != num_layers:
            raise ValueError(f"lengths must give each of the {num_layers} layers, got {len(self.lengths)}")
        if seq is not None:
            held = [store.table(seq, layer).num_tokens for layer in range(num_layers)]
            want = [max(0, min(n, self.hi) - self.lo) for n in self.lengths]
            if held != want:
                raise ValueError(f"sequence {seq} holds {held} tokens per layer; rank {self.rank}'s range of "
                                 f"{self.lengths} is {want}")
        self.seq = store.create_sequence() if seq is None else seq

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] at the sequence's next T positions of `layer` (every rank passes the
        same); this rank stores the part in its range."""
        start = self.lengths[layer]
        a, b = max(start, self.lo), min(start + k.shape[0], self.hi)
        if a < b:
            self.store.append(self.seq, layer, k[a - start: b - start], v[a - start: b - start])
        self.lengths[layer] = start + k.shape[0]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """One decoded token's k, v [1, kv_heads, head_dim]: stored by the last rank only (it holds the tail);
        others only count it. Passing it on every rank keeps the call order alike; only the owner reads it."""
        self.fill(layer, k, v)

    def attend(self, layer: int, q: torch.Tensor, mode: str = "dense", budget: int = 4096) -> torch.Tensor:
        """q [num_q_heads, head_dim] fp16 -> out [num_q_heads, head_dim] fp16: the attention of the whole
        sequence (dense: exactly one process's; topk / sketch: over the union of the ranks' selections)."""
        selected, out, mass, lse = self.attend_shard(layer, q, mode, budget)
        parts = self.group.all_gather(torch.cat([out.float(), lse[:, None]], dim=1))  # [R, Hq, D + 1]
        merged = merge_partials(parts[..., :-1], parts[..., -1])
        if mass is not None:  # mass is a share of this rank's softmax: scaled to the sequence's
            h = self.store.spec.num_kv_heads
            weight = rank_weights(parts[..., -1])[self.rank].view(h, -1).mean(1)  # [H]
            self.store.decode.account(self.store.table(self.seq, layer), selected, mass * weight[:, None])
        return merged

    def attend_shard(self, layer: int, q: torch.Tensor, mode: str,
                     budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(selected int64 [H, k] local block indices, out fp16 [Hq, D], block mass [H, k] or None when nothing
        was attended, lse float32 [Hq]) of this rank's shard."""
        table = self.store.table(self.seq, layer)
        check_query(self.store, q, mode, budget)
        if mode == "sketch":
            self.store.unread.load_if_needed(self.seq)  # an opened shard reads its sketch codes now, as store.attend
        if self.lengths[layer] == 0:
            raise ValueError(f"layer {layer} of the sequence holds no tokens to attend to")
        selected = self.select(table, q, mode, budget, self.lengths[layer])
        if selected.shape[1] == 0:  # none of this rank's blocks: nothing to add to the merge
            empty = torch.full((q.shape[0],), float("-inf"), device=q.device)
            return selected, torch.zeros_like(q), None, empty
        out, mass, lse = self.store.decode.attend_blocks(table, q, selected, return_lse=True)
        return selected, out, mass, lse

    def select(self, table: LayerTable, q: torch.Tensor, mode: str, budget: int, num_tokens: int) -> torch.Tensor:
        """int64 [H, k]: the shard's blocks this rank attends, ascending (the sequence's tail last)."""
        store, n = self.store, table.num_blocks
        window = SeqWindow(num_tokens=num_tokens, block_tokens=self.plan.block_tokens,
                           sink_tokens=store.config.sink_tokens, recent_tokens=store.decode.recent_window(budget))
        k_free = None if mode == "dense" else free_to_select(window, budget)
        if k_free is None:  # every rank decides this alike: no exchange
            return all_blocks(store.spec.num_kv_heads, n, q.device)
        summaries, sketch = table.summaries[:n], table.sketch[:n]
        bounds, protected = shard_scores(store.policies["topk"], window, self.plan.starts[self.rank], summaries, q)
        extra = allot_free_blocks(self.group.all_gather(free_top(bounds, protected, k_free)), k_free)
        return select_shard(mode, store.policies[mode], bounds, protected, int(extra[self.rank]), q, summaries, sketch)


def check_query(store: KVStore, q: torch.Tensor, mode: str, budget: int) -> None:
    """ValueError unless q is fp16 [num_q_heads, head_dim] on the store's device and mode, budget are served."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "sketch" and not store.config.sketch_codes:
        raise ValueError("mode='sketch' reads sketch codes, and this store has none (Config.sketch_codes=False)")
    store.check_query(q, budget)
