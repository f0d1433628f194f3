"""Top-K blocks by the softmax mass a 4-bit key sketch estimates for them (Twilight, Lin et al. 2025;
Double Sparsity, Yang et al. 2024), found in two levels (SparQ, Ribar et al. 2023, for the first), with a
certified bound on what was left out.

Every block keeps a 4-bit sketch of its keys on the GPU wherever its K/V lives
(eviction/sketch.py, ScoreContext.sketch). A step
  1. picks per kv head the `channels` channels of largest |q| (summed over the GQA group),
  2. reads those channels' codes and every channel's min/max for every block (eviction/sketch_channels.py):
     an estimate of each block's softmax mass and an upper bound on its true log-sum-exp,
  3. keeps the max(coarse_factor x k, min_candidates) blocks of highest estimated mass per kv head
     (eviction/sketch_rank.py: each block's share of each head's estimated softmax, averaged over the group),
  4. reads all codes of those (eviction/sketch_kernel.py) and keeps the k of highest 4-bit estimated mass,
     the fine bound replacing the coarse one where it is tighter.
Candidates always include the protected blocks (sinks, recent window). coarse_factor=0, or as many candidates as
blocks, runs one 4-bit pass over every block instead. min_candidates keeps the fine pass, a fixed cost per step,
busy on short contexts, where its tighter bound on more blocks is what makes the certificate tight (with
min_candidates=0 the first level's bound dominates it: certified / true 2.8-9.4x against 1.7-2.8x on real
SmolLM2 keys at 8K: BENCHMARKS.md, Selection quality).

`select_with_bounds` / `select_masked` also return, per q head and block, an upper bound on the log-sum-exp
of the block's true logits: eviction/certify.py turns it and the attention kernel's log-sum-exp of the attended
blocks into a certified omitted mass. Outside the candidates that bound is the first level's (the unread
channels bounded by their min/max: valid, but several nats loose on real keys, so the certificate is looser than
one from 2-bit codes of every channel: BENCHMARKS.md, Selection quality).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eviction.policy import Policy, ScoreContext
from eviction.select import all_blocks, top_blocks
from eviction.sketch_channels import channel_block_stats, channel_block_stats_ref
from eviction.sketch_kernel import refine_candidates, sketch_block_stats, sketch_block_stats_ref
from eviction.sketch_rank import block_shares, block_shares_ref
from eviction.topk_kernel import FASTER_THAN_TORCH, topk_gather_table


@dataclass
class SketchTopK(Policy):
    # channels whose codes the first level reads per block (a multiple of 16 on CUDA); None: head_dim // 2, which
    # finds all 241 needles at 1M (selection 217 us in a graph on the H200); a smaller count trades needles for
    # speed: bench_longctx.sketch_bench; BENCHMARKS.md, Sketch selector
    channels: int | None = None
    # read the channels in adjacent pairs (2p, 2p + 1) of largest summed |q|: 64-byte code rows at 64-token blocks,
    # which the first level copies at less cost than single channels' 32-byte rows; off by default, as it loses one
    # of 241 needles at 1M: bench_longctx.sketch_bench --pairs 0,1; BENCHMARKS.md, Sketch selector
    channel_pairs: bool = False
    coarse_factor: int = 4  # fine-pass candidates per kv head = coarse_factor * k; 0: one full 4-bit pass
    # ... and at least this many (256: the most the top-k kernel's two-stage path selects in one launch)
    min_candidates: int = 256
    use_kernel: bool | None = None  # None: the GPU kernels (Triton; CUDA C++ where built) on CUDA, torch elsewhere
    # tuning knobs of the first level (eviction/sketch_channels.py DEFAULT_KNOBS when empty) and of the fine pass
    # (eviction/sketch_kernel.py); bench_longctx/sketch_bench.py sweeps them
    scan_knobs: dict = field(default_factory=dict)
    candidate_knobs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, low in (("channels", 1), ("coarse_factor", 0), ("min_candidates", 0)):
            value = getattr(self, name)
            if (value is not None or name != "channels") and (isinstance(value, bool) or not isinstance(value, int)
                                                              or value < low):
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """float32 [H, N]: estimated softmax mass per block from the full 4-bit sketch (group mean)."""
        codes = self._codes(ctx)
        lse, _ = self._fine(ctx.summaries, codes)(ctx.q, ctx.summaries, codes, ctx.num_tokens)
        return block_mass(lse, ctx.num_kv_heads)

    def select(self, ctx: ScoreContext, budget_tokens: int) -> torch.Tensor:
        return self.select_with_bounds(ctx, budget_tokens)[0]

    def coarse(self, ctx: ScoreContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(lse, upper) float32 [Hq, N] of the first level over every block (None with coarse_factor=0): what
        `select_with_bounds` reads first; pass it back in to try several budgets on one step (the adaptive
        mode) for one first level."""
        codes = self._codes(ctx)
        return self._first_level(ctx.q, ctx.summaries, codes, ctx.num_tokens, None) if self.coarse_factor else None

    def select_with_bounds(self, ctx: ScoreContext, budget_tokens: int, coarse: tuple[torch.Tensor, torch.Tensor]
                           | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(selected int64 [H, k] rows ascending, block_upper float32 [Hq, N]: upper bounds on each block's
        log-sum-exp of true logits, softmax scale applied)."""
        k = ctx.window.num_selected(budget_tokens)
        codes = self._codes(ctx)
        if k >= ctx.num_blocks:  # everything is attended: nothing to bound
            upper = torch.full((ctx.q.shape[0], ctx.num_blocks), float("-inf"), device=ctx.device)
            return all_blocks(ctx.num_kv_heads, ctx.num_blocks, ctx.device), upper
        keep = ctx.window.protected_mask(ctx.device)
        return self._select(ctx.q, ctx.summaries, codes, ctx.num_tokens, None, keep, k, coarse)[:2]

    def select_masked(self, q: torch.Tensor, summaries: torch.Tensor, sketch: torch.Tensor, valid: torch.Tensor,
                      protected: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(selected int64 [H, k] ascending, block_upper float32 [Hq, N], -inf outside `valid`), with no host
        sync (a captured decode step): the same ranking and bounds as `select_with_bounds` over capacity-sized
        summaries [N, 2, H, D] and sketch whose blocks outside `valid` (bool [N]) may hold garbage;
        `protected` (bool [N]) blocks are kept. Needs k <= the number of valid blocks."""
        num_tokens = summaries.shape[0] * sketch.shape[3]  # every token of a valid block is real but the tail's,
        return self._select(q, summaries, sketch, num_tokens, valid, protected, k, None)[:2]  # and the tail is kept

    def select_masked_table(self, q: torch.Tensor, summaries: torch.Tensor, sketch: torch.Tensor, valid: torch.Tensor,
                            protected: torch.Tensor, k: int, slot_map: torch.Tensor, tier_map: torch.Tensor,
                            int8_tier: int) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """`select_masked` whose final top-k also writes the selection's kernel block table where it runs as a
        kernel (eviction/topk_kernel.py topk_gather_table): (selected, block_upper, (slots int32 [H, k] =
        slot_map[selected], is_int8 bool [H, k] = tier_map[selected] == int8_tier) or None, the caller's to
        gather then)."""
        num_tokens = summaries.shape[0] * sketch.shape[3]
        table = (slot_map, tier_map, int8_tier)
        return self._select(q, summaries, sketch, num_tokens, valid, protected, k, None, table)

    def _select(self, q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, num_tokens: int,
                valid: torch.Tensor | None, keep: torch.Tensor, k: int, first: tuple[torch.Tensor, torch.Tensor] | None,
                table: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """The selection every entry point runs, sync-free: (selected [H, k], upper [Hq, N], the block table
        (slots, is_int8) of the selection when `table` = (slot_map, tier_map, int8_tier) is given and the final
        top-k wrote it, else None); `keep` counts only where `valid` (None: every block) holds."""
        num_blocks, num_kv_heads = summaries.shape[0], summaries.shape[2]
        shares = block_shares if self._on_kernel(q) else block_shares_ref
        if not self._two_level(k, num_blocks):
            lse, upper = self._fine(summaries, codes)(q, summaries, codes, num_tokens)  # [Hq, N] each
            if valid is not None:
                upper = upper.masked_fill(~valid, float("-inf"))
            return top_blocks(shares(lse, keep, valid, num_kv_heads)[0], k), upper, None
        lse, upper = first if first is not None else self._first_level(q, summaries, codes, num_tokens, valid)
        upper = upper.clone() if first is not None else upper  # the fine bounds go in place; a reused one stays
        scores, z = shares(lse, keep, valid, num_kv_heads)  # [H, N], [Hq]
        candidates = top_blocks(scores, self.num_candidates(k))  # [H, C] ascending, the kept ones among them
        live = torch.ones_like(keep) if valid is None else valid
        if self._on_kernel(q):
            fine = refine_candidates(q, summaries, codes, candidates, z, keep, live, upper, num_tokens=num_tokens,
                                     **self.candidate_knobs)
        else:
            fine = refine_candidates_ref(q, summaries, codes, candidates, z, keep, live, upper, num_tokens)
        if table is not None and self._on_kernel(q) and k < candidates.shape[1] <= FASTER_THAN_TORCH:
            selected, slots, is_int8 = topk_gather_table(fine, k, candidates, *table)  # one launch where five were
            return selected, upper, (slots, is_int8)
        return candidates.gather(1, top_blocks(fine, k)), upper, None  # ascending: candidates are

    def _two_level(self, k: int, num_blocks: int) -> bool:
        return bool(self.coarse_factor) and self.num_candidates(k) < num_blocks

    def num_candidates(self, k: int) -> int:
        """Fine-pass candidates per kv head for a selection of k blocks (the first level ranks them)."""
        return max(self.coarse_factor * k, self.min_candidates)

    def _first_level(self, q, summaries, codes, num_tokens, valid) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = summaries.shape[3]
        r = head_dim // 2 if self.channels is None else min(self.channels, head_dim)
        if self._on_kernel(q):
            return channel_block_stats(q, summaries, codes, num_tokens, r, valid, pairs=self.channel_pairs,
                                       **self.scan_knobs)
        return channel_block_stats_ref(q, summaries, codes, num_tokens, r, valid, pairs=self.channel_pairs)

    def _fine(self, summaries: torch.Tensor, codes: torch.Tensor):
        """The full 4-bit stats function (q, summaries, codes, num_tokens) for this device."""
        if not self._on_kernel(summaries):
            return sketch_block_stats_ref
        return lambda *args: sketch_block_stats(*args, **self.candidate_knobs)

    def _on_kernel(self, x: torch.Tensor) -> bool:
        return x.is_cuda if self.use_kernel is None else self.use_kernel

    def _codes(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.q is None or ctx.sketch is None:
            raise ValueError("SketchTopK needs ctx.q (float16 [num_q_heads, head_dim]) and ctx.sketch "
                             f"(eviction/sketch.py codes), got q={type(ctx.q).__name__}, "
                             f"sketch={type(ctx.sketch).__name__}")
        return ctx.sketch


def refine_candidates_ref(q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, candidates: torch.Tensor,
                          z: torch.Tensor, keep: torch.Tensor, valid: torch.Tensor, upper: torch.Tensor,
                          num_tokens: int) -> torch.Tensor:
    """Pure-torch reference of eviction/sketch_kernel.py's `refine_candidates` (scores [H, C]; upper min'ed in
    place); also the CPU path."""
    num_kv_heads = candidates.shape[0]
    group = q.shape[0] // num_kv_heads
    lse, fine_upper = sketch_block_stats_ref(q, summaries, codes, num_tokens, block_ids=candidates)  # [Hq, C]
    live = valid[candidates]  # [H, C]
    tail = live & ~torch.cat((valid[1:], valid.new_zeros(1)))[candidates]
    z = z.masked_fill(z == float("-inf"), float("inf"))  # nothing ranked: every share 0
    share = torch.exp(lse - z[:, None]).view(num_kv_heads, group, -1).mean(1).masked_fill(tail, 0.0)
    scores = torch.where(keep[candidates], float("inf"), share).masked_fill(~live, float("-inf"))
    rows = candidates.repeat_interleave(group, dim=0)  # [Hq, C]
    merged = torch.where(live.repeat_interleave(group, dim=0), torch.minimum(fine_upper, upper.gather(1, rows)),
                         upper.gather(1, rows))
    upper.scatter_(1, rows, merged)
    return scores


def block_mass(lse: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Per-(q head, block) log-sum-exp [Hq, N] -> float32 [H, N]: each block's share of the head's
    softmax, averaged over the GQA group."""
    share = torch.softmax(lse.float(), dim=1)  # [Hq, N]
    return share.view(num_kv_heads, -1, lse.shape[1]).mean(1)
