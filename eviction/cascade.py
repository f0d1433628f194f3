"""Quest's bound in a fitted key basis for candidates, 4-bit key codes to rank them, and a threshold check on
what the candidates left out.

A step, per kv head:
  1. Quest's upper bound (Tang et al. 2024) of every block, from min/max summaries of keys expressed in an
     orthonormal basis fitted to the layer-head's keys (`pca_basis`: their principal directions; q . k does
     not change under a rotation, the box does). On real SmolLM2 keys the bound in that basis is no tighter at
     the median block, but it ranks the blocks that matter higher: the candidates hold more of the oracle's
     blocks (BENCHMARKS.md, Selection quality). A random or Hadamard rotation ranks worse than raw channels.
  2. The protected blocks plus the C = max(candidate_factor x k, min_candidates) blocks of highest bound are
     candidates: only their 4-bit codes (eviction/sketch.py, built in the same basis) are read.
  3. Each candidate's estimated softmax mass (its share of each q head's softmax over the candidates, mean over
     the GQA group) ranks it; the protected blocks plus the k best are kept (the sketch selector's fine pass).
The cost beyond Quest's scan is the 4-bit codes of C of the N blocks per kv head.

Threshold check (`threshold_survivors`): with log_z a lower bound on a q head's log partition sum, a block
whose upper bound is below log(tau) + log_z cannot hold a token with >= tau of that head's softmax weight.
The blocks that pass for some head of the group are the survivors; a kv head is `complete` when every
survivor is a candidate, i.e. the 4-bit ranking saw every block that could hold such a token. log_z here is
the 4-bit lower bound over the protected blocks and the `z_blocks` best-bound blocks of every kv head (codes
the candidates read anyway). With a basis the bounds hold for the fp16-rounded rotated keys the summaries and
codes were built from. On real keys Quest's bound is loose by ~16 nats at the median block, so most blocks
survive: the threshold certifies, it does not prune.

The store's mode "cascade" runs the raw-channel cascade inside the captured decode step
(kvstore/decode/step_select.py): the topk mode's Quest scores, then `select_scored`; store.attend runs
`select`. Both rank through `_rerank`: on CUDA five launches with no host sync (the candidates' top-k in two,
the sketch's fine pass over them, the shares: cascade_kernel.py, the final top-k with its block table), on CPU
their torch references.

Layout: policy -> basis helpers -> the threshold (pure torch: the reference a kernel is checked against).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eviction.policy import Policy, ScoreContext
from eviction.quest_kernel import quest_scores_ref
from eviction.select import SeqWindow, cdiv, top_blocks
from eviction.sketch import token_estimates_ref, token_mask
from eviction.sketch_kernel import sketch_block_stats, sketch_block_stats_ref
from eviction.cascade_kernel import candidate_shares, candidate_shares_ref
from eviction.topk_kernel import FASTER_THAN_TORCH, can_select, topk_gather_table, topk_sorted


@dataclass(slots=True)
class CascadeStats:
    """What a cascade selection saw (per kv head: float32 / bool [H] unless shaped otherwise)."""

    candidates: int  # C, candidates per kv head beyond the protected blocks
    candidate_ids: torch.Tensor  # int64 [H, C + protected]: every block whose codes the ranking read, ascending
    survivors: torch.Tensor  # bool [H, N]: blocks passing the threshold (threshold_survivors)
    log_z: torch.Tensor  # float32 [Hq]: the lower bound on each q head's log partition sum it used
    survivor_fraction: torch.Tensor  # s: unprotected blocks passing the threshold / unprotected blocks
    complete: torch.Tensor  # every survivor was a candidate


@dataclass
class CascadeTopK(Policy):
    # float32 [H, D, D], orthonormal columns: ctx.summaries and ctx.sketch describe keys @ basis (rotate_keys);
    # q is rotated here. None: the raw channels (plain Quest boxes)
    basis: torch.Tensor | None = None
    candidate_factor: int = 16  # candidates per kv head = candidate_factor * k (16 finds 41 of 41 needles at 256K
    # where 4 finds 30, for ~10% more time a token at 1M: BENCHMARKS.md, Cascade) ...
    min_candidates: int = 0  # ... and at least this many
    tau: float = 0.05  # the threshold's token weight
    z_blocks: int = 4  # best-bound blocks per kv head whose 4-bit lower bound joins log_z

    def __post_init__(self) -> None:
        for name, low in (("candidate_factor", 1), ("min_candidates", 0), ("z_blocks", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not 0.0 < self.tau < 1.0:
            raise ValueError(f"tau must be in (0, 1), got {self.tau!r}")
        b = self.basis
        if b is not None and (b.dim() != 3 or b.shape[1] != b.shape[2]):
            raise ValueError(f"basis: expected [kv_heads, head_dim, head_dim], got {list(b.shape)}")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """float32 [H, N]: every block's estimated softmax mass from its 4-bit codes (every block a candidate)."""
        q = self._query(ctx)
        lse, _ = sketch_block_stats_ref(q, ctx.summaries, ctx.sketch, ctx.num_tokens)  # [Hq, N]
        return torch.softmax(lse, dim=1).view(ctx.num_kv_heads, -1, ctx.num_blocks).mean(1)

    def select(self, ctx: ScoreContext, budget_tokens: int) -> torch.Tensor:
        return self._select(ctx, budget_tokens)[0]

    def select_with_stats(self, ctx: ScoreContext, budget_tokens: int) -> tuple[torch.Tensor, CascadeStats]:
        """(selected int64 [H, k] rows ascending, CascadeStats)."""
        selected, candidates, q, upper, bound, keep = self._select(ctx, budget_tokens)
        num_kv_heads, num_blocks = ctx.num_kv_heads, ctx.num_blocks
        log_z = self._log_z_lower(q, ctx, bound, keep)
        survivors = threshold_survivors(upper, log_z, self.tau, num_kv_heads)  # [H, N]
        free = survivors & ~keep
        num_free = num_blocks - int(keep.sum())
        is_candidate = torch.zeros_like(survivors).scatter_(1, candidates, True)
        stats = CascadeStats(candidates=candidates.shape[1] - (num_blocks - num_free), candidate_ids=candidates,
                             survivors=survivors, log_z=log_z, survivor_fraction=free.sum(1).float() / max(num_free, 1),
                             complete=~(free & ~is_candidate).any(1))
        return selected, stats

    def _select(self, ctx: ScoreContext, budget_tokens: int) -> tuple[torch.Tensor, ...]:
        """(selected [H, k], candidates [H, C], q in the basis, per-q-head bound [Hq, N], kv-head bound [H, N]
        with the protected blocks +inf, protected mask [N])."""
        q = self._query(ctx)
        k = ctx.window.num_selected(budget_tokens)
        keep = ctx.window.protected_mask(ctx.device)  # [N]
        upper = quest_upper(q, ctx.summaries)  # [Hq, N]
        bound = upper.view(ctx.num_kv_heads, -1, ctx.num_blocks).amax(1).masked_fill(keep, float("inf"))  # [H, N]
        tail = torch.full((1,), ctx.num_blocks - 1, device=ctx.device)
        selected, candidates, _ = self._rerank(q, ctx.summaries, ctx.sketch, bound, tail, k,
                                               protected_max(ctx.window), ctx.num_tokens)
        return selected, candidates, q, upper, bound, keep

    def select_scored(self, q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, scores: torch.Tensor,
                      tail: torch.Tensor, k: int, most_protected: int,
                      table: tuple | None = None) -> tuple[torch.Tensor, tuple | None]:
        """`select`'s blocks with no host sync (a captured decode step), raw channels only: (int64 [H, k]
        ascending, their block table (slots int32 [H, k], is_int8 bool [H, k]) when `table` = (slot_map,
        tier_map, int8_tier) is given and the final top-k wrote it, else None). scores float32 [H, N]: Quest's
        bound over capacity-sized summaries [N, 2, H, D] and codes, +inf on protected blocks and -inf past the
        live ones (quest_scores_live); tail int64 [1]: the block the current token goes into; most_protected:
        protected_max of the step's window."""
        if self.basis is not None:
            raise ValueError("select_scored ranks raw channels; a basis needs summaries and codes built in it")
        selected, _, gathered = self._rerank(q, summaries, codes, scores, tail, k, most_protected,
                                             scores.shape[1] * codes.shape[3], table)
        return selected, gathered

    def _rerank(self, q: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, bound: torch.Tensor,
                tail: torch.Tensor, k: int, most_protected: int, num_tokens: int,
                table: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """(selected [H, k], candidates [H, C], both ascending, and the block table `select_scored` describes):
        the C = max(candidate_factor x k, min_candidates) + most_protected blocks of highest bound [H, N] (+inf:
        protected, -inf: not live) are candidates; each one's share of its q heads' softmax over the candidates
        (4-bit log-sum-exp, mean over the GQA group) ranks it; the protected ones and the best of the rest make
        k. The tail is left out of the softmax: a captured step writes its codes once it fills. Kernels on CUDA
        (no host sync; eviction/cascade_kernel.py), torch references elsewhere."""
        n = bound.shape[1]
        c = min(max(self.candidate_factor * k, self.min_candidates) + most_protected, n)
        cuda = bound.is_cuda
        candidates = topk_sorted(bound, c) if cuda and can_select(n, c) else top_blocks(bound, c)  # [H, C]
        stats = sketch_block_stats if cuda else sketch_block_stats_ref
        lse, _ = stats(q, summaries, codes, num_tokens, block_ids=candidates)  # [Hq, C]
        ranked = (candidate_shares if cuda else candidate_shares_ref)(lse, bound, candidates, tail)  # [H, C]
        if table is not None and cuda and k < c <= FASTER_THAN_TORCH:
            selected, slots, is_int8 = topk_gather_table(ranked, k, candidates, *table)
            return selected, candidates, (slots, is_int8)
        chosen = topk_sorted(ranked, k) if cuda and can_select(c, k) else top_blocks(ranked, k)
        return candidates.gather(1, chosen), candidates, None

    def _log_z_lower(self, q: torch.Tensor, ctx: ScoreContext, bound: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """float32 [Hq]: a lower bound on each q head's log partition sum over every token, from the 4-bit codes
        of the protected blocks and each kv head's z_blocks best-bound blocks."""
        chosen = keep.clone()
        m = min(self.z_blocks, int((~keep).sum()))
        if m:
            chosen[bound.masked_fill(keep, float("-inf")).topk(m, dim=1).indices.flatten()] = True
        ids = chosen.nonzero().flatten()
        est, err = token_estimates_ref(q, ctx.summaries[ids], ctx.sketch[ids])  # [Hq, n, B], [Hq, n]
        scale = 1.0 / math.sqrt(q.shape[1])
        real = token_mask(ctx.num_tokens, ctx.num_blocks, ctx.window.block_tokens, q.device)[ids]  # [n, B]
        low = ((est - err[..., None]) * scale).masked_fill(~real, float("-inf"))
        return torch.logsumexp(low.flatten(1), dim=1)

    def _query(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.q is None or ctx.sketch is None:
            raise ValueError("CascadeTopK needs ctx.q (float16 [num_q_heads, head_dim]) and ctx.sketch "
                             f"(codes of keys in its basis), got q={type(ctx.q).__name__}, "
                             f"sketch={type(ctx.sketch).__name__}")
        if self.basis is None:
            return ctx.q
        if self.basis.shape[:2] != (ctx.num_kv_heads, ctx.q.shape[1]):
            raise ValueError(f"basis: expected [{ctx.num_kv_heads}, {ctx.q.shape[1]}, {ctx.q.shape[1]}], "
                             f"got {list(self.basis.shape)}")
        return rotate_queries(ctx.q, self.basis.to(ctx.device))


def protected_max(window: SeqWindow) -> int:
    """The most blocks `window` protects at any length: the sinks, the recent window and one partial block."""
    return cdiv(window.sink_tokens, window.block_tokens) + cdiv(window.recent_tokens, window.block_tokens) + 1


def quest_upper(q: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """float32 [Hq, N]: per q head Quest's upper bound on every block's largest logit (softmax scale applied)."""
    num_kv_heads = summaries.shape[2]
    group = q.shape[0] // num_kv_heads
    per_head = [quest_scores_ref(q[g::group], summaries) for g in range(group)]  # G x [H, N] (group of 1)
    return torch.stack(per_head, dim=1).flatten(0, 1) / math.sqrt(q.shape[1])  # [H, G, N] -> [Hq, N]


def threshold_survivors(upper: torch.Tensor, log_z: torch.Tensor, tau: float, num_kv_heads: int) -> torch.Tensor:
    """bool [H, N]: blocks whose upper bound on the largest logit (upper [Hq, N]) reaches log(tau) + log_z for
    some q head of the kv head's group; log_z [Hq] <= the head's log partition sum. Any block holding a token
    with >= tau of some head's softmax weight is a survivor."""
    if not 0.0 < tau < 1.0:
        raise ValueError(f"tau must be in (0, 1), got {tau!r}")
    passes = upper >= (log_z + math.log(tau))[:, None]  # [Hq, N]
    return passes.view(num_kv_heads, -1, upper.shape[1]).any(1)


def pca_basis(keys: torch.Tensor) -> torch.Tensor:
    """keys [T, H, D] -> float32 [H, D, D]: per kv head the eigenvectors (columns) of the keys' covariance."""
    if keys.dim() != 3 or keys.shape[0] < 2:
        raise ValueError(f"keys: expected [T >= 2, kv_heads, head_dim], got {list(keys.shape)}")
    x = keys.float().transpose(0, 1)  # [H, T, D]
    x = x - x.mean(1, keepdim=True)
    return torch.linalg.eigh(x.transpose(1, 2) @ x).eigenvectors


def rotate_keys(keys: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """keys [T, H, D] -> keys @ basis per kv head, in keys' dtype (what summaries and codes are built from)."""
    return torch.einsum("thd,hde->the", keys.float(), basis.to(keys.device, torch.float32)).to(keys.dtype)


def rotate_queries(q: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """q [Hq, D] -> q @ basis of its kv head (q . k is unchanged when both are rotated), in q's dtype."""
    num_kv_heads, head_dim = basis.shape[0], q.shape[1]
    grouped = q.float().view(num_kv_heads, -1, head_dim)  # [H, G, D]
    rotated = torch.einsum("hgd,hde->hge", grouped, basis.to(q.device, torch.float32))
    return rotated.reshape(q.shape).to(q.dtype)
