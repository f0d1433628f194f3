"""The decode path: one query token attends over a sequence's blocks in one layer.

    1. select   per kv head, which blocks to read (dense: all; topk: Quest bound over the
                key summaries; window: sinks + recent; h2o: what drop-mode H2O kept)
    2. stage    selected cold blocks are fetched in one batch into the hot pool's staging rows
    3. attend   one paged decode kernel over hot fp16, warm int8 and staged blocks
    4. account  the kernel's per-block attention mass feeds the H2O scores; blocks fetched
                cold again and again are promoted to the warm tier
On CUDA the Triton kernel runs; on CPU its torch reference (same contract).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstore.attention.reference import paged_decode_ref
from eviction import POLICIES, ScoreContext
from kvstore.placement import COLD, WARM
from kvstore.table import DROPPED, LayerTable

if TYPE_CHECKING:
    from kvstore.store import KVStore

MODES = ("dense", "topk", "h2o", "window")
PROMOTE_AFTER = 2  # cold fetches of one block before it moves to the warm tier


@dataclass
class AttendStats:
    calls: int = 0
    context_tokens: int = 0  # tokens the sequences held
    attended_tokens: int = 0  # tokens the kernel read
    cold_blocks_fetched: int = 0
    promotions: int = 0
    mass_measured: int = 0
    mass_captured: float = 0.0  # summed over measured calls

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["read_fraction"] = self.attended_tokens / self.context_tokens if self.context_tokens else None
        d["mean_mass_captured"] = self.mass_captured / self.mass_measured if self.mass_measured else None
        return d


def attend(store: KVStore, seq: int, layer: int, q: torch.Tensor, mode: str = "dense", budget: int = 4096,
           measure_mass: bool = False) -> torch.Tensor:
    """q [num_q_heads, head_dim] -> attention output [num_q_heads, head_dim] (fp16).

    measure_mass: also run dense attention and record in stats()["attend"] how much of the
    dense softmax mass the selected blocks hold (costs a dense pass; for evaluation)."""
    table = store.table(seq, layer)
    _check_query(store, q, mode, budget)
    if table.num_tokens == 0:
        raise ValueError(f"sequence {seq} layer {layer} holds no tokens to attend to")
    if table.num_dropped and mode != "h2o":
        raise ValueError(f"sequence {seq} layer {layer}: h2o mode dropped blocks; only mode='h2o' can attend it")
    selected = _select(store, seq, layer, table, q, mode, budget)  # int64 [H, k], ascending, tail last
    out, mass = _attend_blocks(store, table, q, selected)
    table.h2o_scores[:, : table.num_blocks].scatter_add_(1, selected, mass)
    _promote_if_needed(store, table)
    stats = store.attend_stats
    stats.calls += 1
    stats.context_tokens += table.num_tokens
    stats.attended_tokens += _tokens_covered(store, table, selected.shape[1])
    if measure_mass and mode != "dense":
        _, dense_mass = _attend_blocks(store, table, q, _live_blocks(store, table))
        stats.mass_measured += 1
        stats.mass_captured += float(dense_mass.gather(1, _live_positions(table, selected)).sum(1).mean())
    return out


def _check_query(store: KVStore, q: torch.Tensor, mode: str, budget: int) -> None:
    spec = store.spec
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget must be a positive int (tokens), got {budget!r}")
    shape = (spec.num_q_heads, spec.head_dim)
    if not isinstance(q, torch.Tensor) or tuple(q.shape) != shape or q.dtype != torch.float16 \
            or q.device.type != store.device.type:
        got = f"{q.dtype} {list(q.shape)} on {q.device}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be float16 {list(shape)} on {store.device.type}, got {got}")


def recent_window(store: KVStore, budget: int) -> int:
    """The recent window a budgeted step always keeps: Config.recent_tokens, at most half the budget,
    so a small budget still leaves room for what the policy picks."""
    return min(store.config.recent_tokens, budget // 2)


def _context(store: KVStore, table: LayerTable, q: torch.Tensor, budget: int) -> ScoreContext:
    c = store.config
    n = table.num_blocks
    return ScoreContext(summaries=table.summaries[:n], num_tokens=table.num_tokens, block_tokens=c.block_tokens,
                        sink_tokens=c.sink_tokens, recent_tokens=recent_window(store, budget), q=q,
                        h2o_scores=table.h2o_scores[:, :n])


def _select(store: KVStore, seq: int, layer: int, table: LayerTable, q: torch.Tensor, mode: str,
            budget: int) -> torch.Tensor:
    if mode == "dense":
        return _live_blocks(store, table)
    if mode == "h2o":
        if not bool(table.h2o_scores[:, : table.num_blocks].any()):
            _, mass = _attend_blocks(store, table, q, _live_blocks(store, table))  # seed: H2O scores prefill too
            table.h2o_scores[:, : table.num_blocks] += mass
        dropped = [i for i, b in enumerate(table.block_ids) if b == DROPPED]
        evict = POLICIES["h2o"]().evict(_context(store, table, q, budget), keep_tokens=budget, dropped=dropped)
        if evict:
            store.drop(seq, layer, evict)
        return _live_blocks(store, table)
    return POLICIES[mode]().select(_context(store, table, q, budget), budget)


def _live_blocks(store: KVStore, table: LayerTable) -> torch.Tensor:
    """int64 [H, n_live]: every block not dropped, for every kv head."""
    if table.num_dropped:
        live = [i for i, b in enumerate(table.block_ids) if b != DROPPED]
        idx = torch.tensor(live, dtype=torch.int64).to(store.device)
    else:
        idx = torch.arange(table.num_blocks, device=store.device)
    return idx.expand(store.spec.num_kv_heads, -1)


def _live_positions(table: LayerTable, selected: torch.Tensor) -> torch.Tensor:
    """Column of each selected block in the dense (live-only) selection."""
    if not table.num_dropped:
        return selected
    live = torch.tensor([b != DROPPED for b in table.block_ids], device=selected.device)
    return (live.cumsum(0) - 1)[selected]


def _tokens_covered(store: KVStore, table: LayerTable, k: int) -> int:
    """Tokens in k selected blocks: full blocks, then the partial tail block (always last)."""
    b = store.config.block_tokens
    return (k - 1) * b + table.num_tokens - (table.num_blocks - 1) * b


def _attend_blocks(store: KVStore, table: LayerTable, q: torch.Tensor,
                   selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the paged kernel over `selected` [H, k]; returns (out [Hq, D], block mass [H, k])."""
    slots = table.slot_map[selected]  # [H, k] int32
    is_int8 = table.level_map[selected] == WARM
    hot_pool = store.hot.pool
    if table.num_cold:
        hot_pool, slots, is_int8 = _stage_cold(store, table, selected, slots, is_int8)
    num_tokens = torch.tensor([_tokens_covered(store, table, selected.shape[1])], dtype=torch.int32)
    warm = store.warm.pool
    if not table.num_warm:  # no int8 block in the table: the kernel's pure-fp16 build
        warm = warm.index(slice(0, 0))
    kernel = _kernel(store.device)
    out, mass = kernel(q[None], hot_pool, warm.data, warm.k_scale, warm.v_scale, slots[None], is_int8[None],
                       num_tokens.to(store.device), return_block_mass=True)
    return out[0], mass[0]


def _kernel(device: torch.device):
    if device.type == "cuda":
        from kvstore.attention.paged_decode import paged_decode

        return paged_decode
    return paged_decode_ref


def _stage_cold(store: KVStore, table: LayerTable, selected: torch.Tensor, slots: torch.Tensor,
                is_int8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fetch the selected cold blocks in one batch; returns (fp16 pool, slots, is_int8) to attend with."""
    cold = table.level_map[selected] >= COLD  # [H, k]
    cold_indices = torch.unique(selected[cold]).tolist()  # one host sync, only when the table has cold blocks
    if not cold_indices:
        return store.hot.pool, slots, is_int8
    store.attend_stats.cold_blocks_fetched += len(cold_indices)
    remap = torch.full((table.num_blocks,), -1, dtype=torch.int32, device=store.device)
    if len(cold_indices) <= store.hot.staging_blocks:
        staged = store.hot.stage(store.gather([table.block_ids[i] for i in cold_indices]))
        remap[torch.tensor(cold_indices, device=store.device)] = staged
        pool, slots = store.hot.pool, torch.where(cold, remap[selected], slots)
        is_int8 = is_int8 & ~cold
    else:  # more than staging holds: attend over a temporary fp16 copy of every selected block
        every = torch.unique(selected).tolist()
        pool = store.gather([table.block_ids[i] for i in every])
        remap[torch.tensor(every, device=store.device)] = torch.arange(len(every), dtype=torch.int32,
                                                                        device=store.device)
        slots, is_int8 = remap[selected], torch.zeros_like(is_int8)
    for i in cold_indices:
        table.cold_hits[i] = table.cold_hits.get(i, 0) + 1
    return pool, slots, is_int8


def _promote_if_needed(store: KVStore, table: LayerTable) -> None:
    """Blocks fetched cold PROMOTE_AFTER times move up to the warm tier. Runs after the step's kernel:
    making room in the warm pool may move blocks this step's block table still points at."""
    ready = [i for i, hits in table.cold_hits.items() if hits >= PROMOTE_AFTER]
    for i in ready:
        del table.cold_hits[i]
    cold = [b for b in (table.block_ids[i] for i in ready) if b != DROPPED and store.blocks.tier_of[b] >= COLD]
    for src, ids in store.blocks.by_tier(cold).items():
        store._move(ids, src, WARM)
        store.attend_stats.promotions += len(ids)
