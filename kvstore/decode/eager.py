"""The decode path: one query token attends over a sequence's blocks in one layer.

    1. select   per kv head, which blocks to read (dense: all; a policy's `select` under the
                budget; H2O drop mode: drop the least attended for good, attend the rest)
    2. stage    selected cold blocks are fetched in one batch, in their stored format, into the staging
                rows of the hot (fp16) and warm (int8) pools (staging.py)
    3. attend   one paged decode kernel over hot fp16, warm int8 and staged blocks
    4. account  the kernel's per-block attention mass feeds the H2O scores; blocks fetched
                cold again and again are promoted to the warm tier, and blocks read again from an
                opened context's save are kept in the tier of their position (kvstore/blocks/from_saved.py)
On CUDA the Triton kernel runs; on CPU its torch reference (same contract). The eager
step, the captured step (step.py) and the benchmarks build block tables with the
one `block_table` below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eviction import H2O, Policy, ScoreContext
from eviction.certify import certified_omitted_mass
from eviction.select import SeqWindow
from eviction.sketch_topk import SketchTopK
from kvstore.attention import kernel_for
from kvstore.blocks.from_saved import KEEP_AFTER, keep_read, take_rows
from kvstore.blocks.promotion import PROMOTE_AFTER, Promoter
from kvstore.blocks.table import DROPPED, LayerTable
from kvstore.blocks.tierset import CPU_TIER, SAVED_TIER, WARM_TIER, TierSet
from kvstore.config import Config
from kvstore.decode.staging import stage
from tiers.stored import StoredBlocks



@dataclass
class AttendStats:
    calls: int = 0
    context_tokens: int = 0  # tokens the sequences held
    attended_tokens: int = 0  # tokens the kernel read
    cold_blocks_fetched: int = 0
    cold_slices_staged: int = 0  # one kv head's slice of a cpu block, read by a captured step (DecodeStep.verify)
    promotions: int = 0
    promotion_swaps: int = 0  # warm blocks moved down to the cpu tier to make room for a promotion
    kept_from_saved: int = 0  # blocks read from an opened context's save and kept in a tier (keep_saved)
    mass_measured: int = 0
    mass_captured: float = 0.0  # summed over measured calls
    certified_calls: int = 0  # calls whose policy certified its omitted mass (SketchTopK)
    certified_omitted: float = 0.0  # summed: per call the mean over kv heads of the certified bound
    true_omitted: float = 0.0  # summed over calls both certified and measured: 1 - captured mass
    certified_measured: int = 0
    certificate_violations: int = 0  # measured calls where some head's bound fell below its true omitted mass
    step_calls: int = 0  # store.attend calls the DecodeStep's code served (kvstore/decode/eager_step.py)
    fallback_calls: dict[str, int] = field(default_factory=dict)  # store.attend calls this DecodePath served, by why
    _certified: torch.Tensor | None = field(default=None, repr=False)  # device sum of bounds not yet read

    def count_token(self, layers: int, num_tokens: int, selected_blocks: int, block_tokens: int,
                    certified: torch.Tensor | None) -> None:
        """A captured step's token over `layers` layers of a sequence of num_tokens (this token included) that
        read selected_blocks blocks a layer, the last of them its tail; certified: its bounds [layers] or None."""
        self.calls += layers
        self.context_tokens += layers * num_tokens
        self.attended_tokens += layers * ((selected_blocks - 1) * block_tokens + (num_tokens - 1) % block_tokens + 1)
        if certified is not None:
            self.add_certified(certified)

    def add_certified(self, bounds: torch.Tensor) -> None:
        """Count calls' certified omitted masses (bounds [calls], each a mean over kv heads, on the device)
        without a host sync: added into one device scalar, read when the stats are."""
        self.certified_calls += bounds.numel()
        total = bounds.sum()
        self._certified = total if self._certified is None else self._certified + total

    def as_dict(self) -> dict:
        pending, self._certified = self._certified, None  # one swap: a bound added meanwhile is kept for later
        if pending is not None:
            self.certified_omitted += float(pending)
        d = {name: dict(value) if isinstance(value, dict) else value for name, value in self.__dict__.items()
             if not name.startswith("_")}
        d["read_fraction"] = self.attended_tokens / self.context_tokens if self.context_tokens else None
        d["mean_mass_captured"] = self.mass_captured / self.mass_measured if self.mass_measured else None
        d["mean_certified_omitted"] = self.certified_omitted / self.certified_calls if self.certified_calls else None
        d["mean_true_omitted"] = self.true_omitted / self.certified_measured if self.certified_measured else None
        return d


def tokens_covered(table: LayerTable, k: int, block_tokens: int) -> int:
    """Tokens in k selected blocks of `table`: full blocks, then the partial tail block (always last)."""
    return (k - 1) * block_tokens + table.num_tokens - (table.num_blocks - 1) * block_tokens


def block_table(table: LayerTable, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel block table of `selected` [H, k]: (slots int32 [H, k], is_int8 bool [H, k]); no host sync."""
    return table.slot_map[selected], table.tier_map[selected] == WARM_TIER


# A budgeted step forces at most budget / RECENT_SHARE recent tokens. On real Q/K (SmolLM2, 8K context, budgets
# 1/16 and 1/8) half the budget left every selector, even a perfect one, 2-3 points short of the mass the best
# blocks hold, and an eighth gave lower perplexity in every mode (BENCHMARKS.md, "The forced recent window").
RECENT_SHARE = 8


class DecodePath:
    def __init__(self, config: Config, tiers: TierSet) -> None:
        self.block_tokens, self.sink_tokens = config.block_tokens, config.sink_tokens
        self.recent_tokens = config.recent_tokens
        self.tiers = tiers
        self.device = tiers.device
        self.kernel = kernel_for(self.device)
        self.stats = AttendStats()
        self.promoter = Promoter(tiers, config, config.recent_tokens)
        limit = config.promotions_per_boundary  # a captured step's per boundary; here a share per layer and call
        self.promote_limit = max(1, limit // config.model.num_layers) if limit else 0

    def recent_window(self, budget: int) -> int:
        """The recent window a budgeted step always keeps: Config.recent_tokens, at most budget / RECENT_SHARE,
        so most of the budget is left to what the policy picks."""
        return min(self.recent_tokens, budget // RECENT_SHARE)

    def context(self, table: LayerTable, q: torch.Tensor, budget: int) -> ScoreContext:
        """What a policy sees of `table` at this step (validated once, here)."""
        n = table.num_blocks
        window = SeqWindow(num_tokens=table.num_tokens, block_tokens=self.block_tokens,
                           sink_tokens=self.sink_tokens, recent_tokens=self.recent_window(budget))
        return ScoreContext(summaries=table.summaries[:n], window=window, q=q, h2o_scores=table.h2o_scores[:, :n],
                            sketch=table.sketch if table.sketch.shape[-1] else None)  # none: Config.sketch_codes

    def attend(self, table: LayerTable, q: torch.Tensor, policy: Policy | None, budget: int,
               measure_mass: bool = False, epsilon: float | None = None) -> torch.Tensor:
        """q [num_q_heads, head_dim] -> out [num_q_heads, head_dim] (fp16). policy None: dense.

        measure_mass: also run dense attention and record in the stats how much of the dense
        softmax mass the selected blocks hold (costs a dense pass; for evaluation).
        epsilon (SketchTopK only): grow the selection in power-of-two block counts until the certified
        omitted mass of every kv head is <= epsilon or `budget` tokens are selected."""
        certified = None
        if isinstance(policy, SketchTopK):
            selected, out, mass, certified = self.attend_certified(table, q, policy, budget, epsilon)
        else:
            if epsilon is not None:
                raise ValueError(f"epsilon needs the sketch top-K policy (mode='sketch'), got {type(policy).__name__}")
            selected = self.select(table, q, policy, budget)  # int64 [H, k], ascending, tail last
            out, mass = self.attend_blocks(table, q, selected)
        self.account(table, selected, mass)
        if certified is not None:
            self.stats.add_certified(certified.mean().reshape(1))
        if measure_mass and policy is not None:
            _, dense_mass = self.attend_blocks(table, q, self.live_blocks(table))
            captured = dense_mass.gather(1, _live_positions(table, selected)).sum(1)  # [H]
            self.stats.mass_measured += 1
            self.stats.mass_captured += float(captured.mean())
            if certified is not None:
                true = (1 - captured).clamp_min(0)
                self.stats.certified_measured += 1
                self.stats.true_omitted += float(true.mean())
                self.stats.certificate_violations += int(bool((certified + 1e-5 < true * (1 - 1e-3)).any()))
        return out

    def account(self, table: LayerTable, selected: torch.Tensor, mass: torch.Tensor) -> None:
        """After an attend over `selected` [H, k]: its block mass [H, k] into the H2O scores, cold blocks
        promoted, the call counted (kvstore.parallel runs its own selection, then this)."""
        table.h2o_scores[:, : table.num_blocks].scatter_add_(1, selected, mass)
        self.promote_if_needed(table)
        self.stats.calls += 1
        self.stats.context_tokens += table.num_tokens
        self.stats.attended_tokens += tokens_covered(table, selected.shape[1], self.block_tokens)

    def attend_certified(self, table: LayerTable, q: torch.Tensor, policy: SketchTopK, budget: int,
                         epsilon: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(selected [H, k], out [Hq, D], block mass [H, k], certified omitted mass [H]) of a sketch selection:
        at `budget`, or (epsilon) at the first power-of-two block count whose bound is <= epsilon."""
        ctx = self.context(table, q, budget)
        b = self.block_tokens
        most = ctx.window.num_selected(budget)
        sizes = [most]
        if epsilon is not None:
            if not 0 < epsilon < 1:
                raise ValueError(f"epsilon must be in (0, 1), got {epsilon!r}")
            k = 1 << ctx.window.num_protected().bit_length()  # a power of two above the protected blocks
            sizes = []
            while k < most:  # block counts a captured graph could replay: powers of two, then the budget
                sizes.append(k)
                k *= 2
            sizes.append(most)
        coarse = policy.coarse(ctx) if policy.coarse_factor and len(sizes) > 1 else None
        for k in sizes:  # each try attends for real: its exact log-sum-exp is what the bound needs
            selected, upper = policy.select_with_bounds(ctx, k * b, coarse=coarse)
            out, mass, lse = self.attend_blocks(table, q, selected, return_lse=True)
            certified = certified_omitted_mass(upper, selected, lse)
            if epsilon is None or float(certified.max()) <= epsilon:
                break
        return selected, out, mass, certified

    def select(self, table: LayerTable, q: torch.Tensor, policy: Policy | None, budget: int) -> torch.Tensor:
        if policy is None:
            return self.live_blocks(table)
        if isinstance(policy, H2O):  # drop mode: evicted blocks are freed for good
            if not bool(table.h2o_scores[:, : table.num_blocks].any()):
                _, mass = self.attend_blocks(table, q, self.live_blocks(table))  # seed: H2O scores prefill too
                table.h2o_scores[:, : table.num_blocks] += mass
            dropped = [i for i, b in enumerate(table.block_ids) if b == DROPPED]
            evict = policy.evict(self.context(table, q, budget), keep_tokens=budget, dropped=dropped)
            if evict:
                self.tiers.drop(table, evict)
            return self.live_blocks(table)
        return policy.select(self.context(table, q, budget), budget)

    def live_blocks(self, table: LayerTable) -> torch.Tensor:
        """int64 [H, n_live]: every block not dropped, for every kv head."""
        if table.num_dropped:
            idx = torch.tensor(table.live_indices(), dtype=torch.int64).to(self.device)
        else:
            idx = torch.arange(table.num_blocks, device=self.device)
        return idx.expand(table.h2o_scores.shape[0], -1)

    def attend_blocks(self, table: LayerTable, q: torch.Tensor, selected: torch.Tensor,
                      return_lse: bool = False) -> tuple[torch.Tensor, ...]:
        """Run the paged kernel over `selected` [H, k]; returns (out [Hq, D], block mass [H, k]) and with
        return_lse the log-sum-exp [Hq] of the attended logits (what the certified bound needs)."""
        slots, is_int8 = block_table(table, selected)
        got = stage(self.tiers, table, selected, slots, is_int8)  # both pools, always: staging.py says why
        self.stats.cold_blocks_fetched += len(got.fetched)
        for i in got.fetched:
            table.cold_hits[i] = table.cold_hits.get(i, 0) + 1
        num_tokens = torch.tensor([tokens_covered(table, selected.shape[1], self.block_tokens)], dtype=torch.int32)
        warm = got.warm
        lse = torch.empty((1, q.shape[0]), dtype=torch.float32, device=self.device) if return_lse else None
        out, mass = self.kernel(q[None], got.hot_pool, warm.data, warm.k_scale, warm.v_scale, got.slots[None],
                                got.is_int8[None], num_tokens.to(self.device), return_block_mass=True, lse_out=lse)
        if got.read is not None:
            self.keep_saved(table, got.read, got.read_at)
        return (out[0], mass[0]) if lse is None else (out[0], mass[0], lse[0])

    def keep_saved(self, table: LayerTable, read: StoredBlocks, read_at: list[int]) -> None:
        """Blocks this step read from the saved tier (an opened context's) for at least the KEEP_AFTER-th time
        (reads are counted per attend, so two tries within one token count twice: the sketch's epsilon sizes, H2O's
        seeding pass) stay out of it: into the tier of their position, as far as it has free room (kvstore/blocks/from_saved.py),
        so later tokens read only what they select anew. After the kernel: the blocks move, the rows it read stay
        where they were."""
        if not self.tiers.saved.num_blocks:  # no opened context left in its save
            return
        hits, tier_of, ids_of = table.cold_hits, self.tiers.blocks.tier_of, table.block_ids
        for at, blocks in read.parts():
            rows = [r for r, a in enumerate(at) if hits.get(read_at[a], 0) >= KEEP_AFTER
                    and tier_of.get(ids_of[read_at[a]]) == SAVED_TIER]
            if rows:
                indices = [read_at[at[r]] for r in rows]
                ids = [table.block_ids[i] for i in indices]
                self.stats.kept_from_saved += keep_read(self.tiers, table, indices, ids, take_rows(blocks, rows))

    def promote_if_needed(self, table: LayerTable) -> None:
        """Cold blocks fetched PROMOTE_AFTER times move up to the warm tier by the rule both decode paths share
        (kvstore/blocks/promotion.py), most fetched first, at most promote_limit a call. Those weighed here count
        from zero again, moved or not (a block the rule keeps down is weighed again after PROMOTE_AFTER more
        fetches, not every call); those past the limit keep their counts for the next call. Runs after the
        step's kernel: making room in the warm pool may move blocks this step's block table still points at."""
        hits = table.cold_hits
        ready = sorted((i for i, n in hits.items() if n >= PROMOTE_AFTER), key=lambda i: -hits[i])
        if not ready or not self.promote_limit:
            return
        tier_of = self.tiers.blocks.tier_of
        cold = [i for i in ready if table.block_ids[i] != DROPPED and tier_of[table.block_ids[i]] >= CPU_TIER]
        weighed = cold[: self.promote_limit]
        _, moved, swaps = self.promoter.promote([table], [(0, i) for i in weighed], table.num_blocks) \
            if weighed else ([], 0, 0)
        self.stats.promotions += moved
        self.stats.promotion_swaps += swaps
        for i in set(ready) - set(cold[self.promote_limit:]):
            del hits[i]


def _live_positions(table: LayerTable, selected: torch.Tensor) -> torch.Tensor:
    """Column of each selected block in the dense (live-only) selection."""
    if not table.num_dropped:
        return selected
    live = torch.tensor([b != DROPPED for b in table.block_ids], device=selected.device)
    return (live.cumsum(0) - 1)[selected]
