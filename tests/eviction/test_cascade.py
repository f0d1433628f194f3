from __future__ import annotations

import math

import pytest
import torch

from eviction import TopK
from eviction.cascade_kernel import candidate_shares, candidate_shares_ref
from eviction.cascade import (CascadeTopK, pca_basis, protected_max, quest_upper, rotate_keys, rotate_queries,
                              threshold_survivors)
from eviction.policy import ScoreContext
from eviction.select import SeqWindow, cdiv, select
from eviction.sketch import sketch_keys
from eviction.summaries import summarize_keys

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (tokens, block_tokens, kv_heads, group, head_dim): partial tails, GQA groups of 1-4, odd block counts
SHAPES = [(203, 8, 2, 3, 12), (97, 16, 1, 4, 16), (333, 10, 3, 1, 8), (64, 4, 2, 2, 20)]


def keys_and_q(tokens: int, heads: int, group: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 keys [T, H, D] with correlated channels and a few outlier channels (real keys' shape), q [Hq, D]."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(heads, dim, dim, generator=g) / math.sqrt(dim)
    keys = torch.einsum("thd,hde->the", torch.randn(tokens, heads, dim, generator=g), mix) * 2.0
    keys[:, :, :2] += 6.0 * torch.randn(1, heads, 2, generator=g)  # near-constant outlier channels
    q = torch.randn(heads * group, dim, generator=g) * 1.5
    return keys.half(), q.half()


def context(keys: torch.Tensor, q: torch.Tensor, block_tokens: int, basis: torch.Tensor | None,
            sink: int = 8, recent: int = 8) -> ScoreContext:
    window = SeqWindow(num_tokens=keys.shape[0], block_tokens=block_tokens, sink_tokens=sink, recent_tokens=recent)
    summaries, codes = sketch_keys(keys if basis is None else rotate_keys(keys, basis), block_tokens)
    return ScoreContext(summaries, window, q=q, sketch=codes)


def case(shape: tuple, seed: int, use_basis: bool = True) -> tuple:
    """(keys, q, basis or None, ScoreContext) of one SHAPES entry."""
    tokens, b, heads, group, dim = shape
    keys, q = keys_and_q(tokens, heads, group, dim, seed=seed)
    basis = pca_basis(keys) if use_basis else None
    return keys, q, basis, context(keys, q, b, basis)


def true_logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """float64 [Hq, T], softmax scale applied, brute force over every token."""
    heads, group = keys.shape[1], q.shape[0] // keys.shape[1]
    rows = [q[i].double() @ keys[:, i // group].double().T for i in range(q.shape[0])]
    return torch.stack(rows) / math.sqrt(q.shape[1])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("use_basis", [False, True])
@pytest.mark.parametrize("tau", [0.05, 0.3])
def test_threshold_never_prunes_a_heavy_token(shape, use_basis, tau):
    tokens, b, heads, group, dim = shape
    keys, q = keys_and_q(tokens, heads, group, dim, seed=tokens + dim)
    basis = pca_basis(keys) if use_basis else None
    ctx = context(keys, q, b, basis)
    _, stats = CascadeTopK(basis=basis, tau=tau, z_blocks=2).select_with_stats(ctx, 3 * b)
    logits = true_logits(q, keys)
    assert (stats.log_z.double() <= torch.logsumexp(logits, 1) + 1e-4).all()  # a lower bound on log Z
    weight = torch.softmax(logits, 1)  # [Hq, T]
    n = cdiv(tokens, b)
    padded = torch.nn.functional.pad(weight, (0, n * b - tokens)).view(q.shape[0], n, b)
    heavy = (padded.amax(-1) >= tau).view(heads, group, n).any(1)  # [H, N]: holds a token with >= tau
    assert (stats.survivors | ~heavy).all(), "a block holding a token with >= tau of the weight was pruned"
    # every block above the threshold by brute force over its tokens survives too
    above = (torch.nn.functional.pad(logits, (0, n * b - tokens), value=-math.inf).view(q.shape[0], n, b).amax(-1)
             >= (stats.log_z.double() + math.log(tau))[:, None]).view(heads, group, n).any(1)
    assert (stats.survivors | ~above).all()


def test_threshold_prunes_when_the_partition_sum_is_known():
    keys, q = keys_and_q(256, 2, 2, 16, seed=3)
    keys[17] = (q.float().view(2, 2, 16).sum(1) * 3.0).half()  # a needle for each kv head's group
    summaries = summarize_keys(keys, 8)
    upper = quest_upper(q, summaries)
    log_z = torch.logsumexp(true_logits(q, keys), 1).float()
    survivors = threshold_survivors(upper, log_z, 0.05, 2)
    assert survivors[:, 2].all()  # the needle's block
    assert survivors.float().mean(1).min() < 0.2  # the threshold does prune once one token dominates
    assert (upper >= true_logits(q, keys).view(4, 32, 8).amax(-1).float() - 1e-3).all()  # a bound per q head


@pytest.mark.parametrize("shape", SHAPES)
def test_every_block_a_candidate_is_the_full_4bit_ranking(shape):
    tokens, b, heads, group, dim = shape
    keys, q, basis, ctx = case(shape, seed=7)
    policy = CascadeTopK(basis=basis, candidate_factor=1, min_candidates=ctx.num_blocks)
    budget = 4 * b
    selected, stats = policy.select_with_stats(ctx, budget)
    assert torch.equal(selected, select(policy.score(ctx), ctx.window, budget))
    assert stats.complete.all() and stats.candidates == ctx.num_blocks - ctx.window.num_protected()


@pytest.mark.parametrize("shape", SHAPES)
def test_candidates_are_quest_in_the_basis(shape):
    tokens, b, heads, group, dim = shape
    keys, q, basis, ctx = case(shape, seed=11)
    budget = 5 * b
    selected, stats = CascadeTopK(basis=basis, candidate_factor=2).select_with_stats(ctx, budget)
    k = ctx.window.num_selected(budget)
    # C = candidate_factor x k + the most blocks the window can protect, the protected ones among them
    assert stats.candidates == min(2 * k + protected_max(ctx.window), ctx.num_blocks) - ctx.window.num_protected()
    bound = quest_upper(rotate_queries(q, basis), ctx.summaries).view(heads, group, -1).amax(1)  # [H, N]
    assert selected.shape == (heads, k) and (selected.diff(dim=1) > 0).all()
    protected = ctx.window.protected_mask()
    free_bound = bound.masked_fill(protected, -math.inf)
    cutoff = free_bound.topk(stats.candidates, dim=1).values[:, -1:]  # [H, 1]: the last candidate's bound
    picked = free_bound.gather(1, selected)
    assert ((picked >= cutoff) | protected[selected]).all(), "a block outside Quest's top C was selected"
    assert (protected[selected].sum(1) == int(protected.sum())).all()


def test_rotation_keeps_logits():
    keys, q = keys_and_q(150, 3, 2, 16, seed=5)
    basis = pca_basis(keys)
    eye = torch.eye(16).expand(3, 16, 16)
    assert torch.allclose(basis.transpose(1, 2) @ basis, eye, atol=1e-5)
    rotated = true_logits(rotate_queries(q.float(), basis), rotate_keys(keys.float(), basis))
    assert torch.allclose(rotated, true_logits(q, keys), atol=1e-3)


def test_bad_arguments():
    for kwargs in ({"candidate_factor": 0}, {"tau": 1.0}, {"z_blocks": -1}, {"basis": torch.eye(4)}):
        with pytest.raises(ValueError):
            CascadeTopK(**kwargs)
    keys, q = keys_and_q(64, 2, 2, 8, seed=1)
    ctx = context(keys, q, 8, None)
    with pytest.raises(ValueError, match="basis"):
        CascadeTopK(basis=torch.eye(8).expand(3, 8, 8)).select(ctx, 16)
    with pytest.raises(ValueError, match="sketch"):
        CascadeTopK().select(ScoreContext(ctx.summaries, ctx.window, q=q), 16)


def needle_haystack(seed: int, blocks: int = 256, b: int = 16, heads: int = 2, group: int = 2, dim: int = 32,
                    decoys: int = 40, needles: int = 4) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(keys fp16 [T, H, D], q fp16 [Hq, D], needle blocks): `decoys` blocks hold one large key orthogonal to
    the query (a wide min/max box, logit ~0: Quest's bound ranks them first), `needles` blocks one key along it
    (a logit of 2.5 sqrt(D) |q|, most of the softmax): more decoys than the budget's k, fewer than the cascade's
    candidates."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(blocks * b, heads, dim, generator=g) * 0.5
    q = torch.randn(heads * group, dim, generator=g)
    direction = q.view(heads, group, dim).mean(1)
    direction = direction / direction.norm(dim=1, keepdim=True)  # [H, D]
    planted = (torch.randperm(blocks - 20, generator=g)[: decoys + needles] + 10).tolist()
    for i, block in enumerate(planted):
        t = block * b + int(torch.randint(0, b, (1,), generator=g))
        for h in range(heads):
            if i < decoys:
                o = torch.randn(dim, generator=g) * 6
                keys[t, h] = o - (o @ direction[h]) * direction[h]
            else:
                keys[t, h] = direction[h] * 2.5 * math.sqrt(dim)
    return keys.half(), q.half(), planted[decoys:]


def test_cascade_finds_the_needles_quest_ranks_below_decoys():
    """Graded: Quest's bound alone finds few of the needles (decoys outrank them), the cascade all, from 4 x k
    candidates (64 of the 256 blocks: at the default 16 x k every block would be a candidate)."""
    found, total = {"topk": 0, "cascade": 0}, 0
    for seed in range(6):
        keys, q, needles = needle_haystack(seed)
        window = SeqWindow(num_tokens=keys.shape[0], block_tokens=16, sink_tokens=16, recent_tokens=32)
        summaries, codes = sketch_keys(keys, 16)
        ctx = ScoreContext(summaries, window, q=q, sketch=codes)
        for name, policy in (("topk", TopK()), ("cascade", CascadeTopK(candidate_factor=4))):
            selected = policy.select(ctx, 256)  # k = 16 blocks of 256
            found[name] += sum(needle in row for row in selected.tolist() for needle in needles)
        total += 2 * len(needles)
    assert found["topk"] <= total // 4, found
    assert found["cascade"] == total, found


@pytest.mark.parametrize("heads, group, n, c", [(2, 3, 40, 13), (3, 1, 300, 70), (1, 4, 17, 17)])
def test_candidate_shares_kernel_matches_reference(heads, group, n, c):
    """The one-launch ranking (TRITON_INTERPRET=1 on CPU) against its torch reference, with protected (+inf),
    dead (-inf) and tail candidates and a q head whose every candidate is uncounted."""
    g = torch.Generator().manual_seed(heads * 100 + n)
    bound = torch.randn((heads, n), generator=g) * 3
    bound[:, :2] = math.inf  # sinks
    bound[:, -3:] = -math.inf  # past the live blocks
    candidates = torch.stack([torch.randperm(n, generator=g)[:c].sort().values for _ in range(heads)])
    lse = torch.randn((heads * group, c), generator=g) * 4
    tail = torch.tensor([int(candidates[0, -1])])
    want = candidate_shares_ref(lse, bound, candidates, tail)
    got = candidate_shares(lse.to(DEVICE), bound.to(DEVICE), candidates.to(DEVICE), tail.to(DEVICE)).cpu()
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got.sign(), want.sign())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-7)
    assert finite.any() and (want[finite] > 0).any()  # shares to rank, not only protected or dead candidates
