"""The certified omitted mass is never below the true omitted mass: random and adversarial cases, every case."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eviction.policy import ScoreContext
from eviction.select import SeqWindow
from eviction.certify import (attended_lse, certified_omitted_mass, omitted_mass_bounds,
                              omitted_mass_bounds_ref, true_omitted_mass)
from eviction.certify_kernel import omitted_mass_bounds_kernel
from eviction.sketch import sketch_keys
from eviction.sketch_topk import SketchTopK

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[Hq, T] scaled logits, fp32."""
    num_kv_heads, head_dim = keys.shape[1], keys.shape[2]
    raw = torch.einsum("hgd,thd->hgt", q.float().view(num_kv_heads, -1, head_dim), keys.float()).flatten(0, 1)
    return raw / math.sqrt(head_dim)


def _certify(q, keys, block_tokens, budget, policy, sink=16, recent=32):
    summaries, codes = sketch_keys(keys, block_tokens)
    window = SeqWindow(num_tokens=keys.shape[0], block_tokens=block_tokens, sink_tokens=sink, recent_tokens=recent)
    ctx = ScoreContext(summaries, window, q=q, sketch=codes)
    chosen, upper = policy.select_with_bounds(ctx, budget)
    logits = _logits(q, keys)
    certified = certified_omitted_mass(upper, chosen, attended_lse(logits, chosen, block_tokens))
    return certified, true_omitted_mass(logits, chosen, block_tokens), chosen


def _never_below(certified: torch.Tensor, true: torch.Tensor) -> None:
    assert (certified >= true * (1 - 1e-5) - 1e-7).all(), f"certified {certified.tolist()} < true {true.tolist()}"
    assert (certified <= 1).all()


def test_exact_block_bounds_certify_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 100, generator=g) * 3  # [Hq, T], 2 kv heads x 3
    selected = torch.tensor([[0, 3, 6], [1, 2, 6]])  # [H, k] of 7 blocks of 16
    padded = torch.nn.functional.pad(logits, (0, 12), value=float("-inf")).view(6, 7, 16)
    certified = certified_omitted_mass(padded.logsumexp(-1), selected, attended_lse(logits, selected, 16))
    torch.testing.assert_close(certified, true_omitted_mass(logits, selected, 16))
    nothing_left = certified_omitted_mass(padded.logsumexp(-1), torch.arange(7).expand(2, 7),
                                          attended_lse(logits, torch.arange(7).expand(2, 7), 16))
    assert torch.equal(nothing_left, torch.zeros(2))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_tokens=st.integers(97, 700), block_tokens=st.sampled_from([16, 32]),
       budget=st.integers(48, 400), sharpness=st.sampled_from([0.5, 2.0, 8.0]), coarse_factor=st.sampled_from([0, 2, 4]))
def test_certificate_is_never_below_true_on_random_keys(seed, num_tokens, block_tokens, budget, sharpness,
                                                        coarse_factor) -> None:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_tokens, 2, 64, generator=g)
    keys[..., :3] *= 6.0  # high-variance channels and a shared mean direction, as SmolLM2's keys have
    keys = (keys + 1.5 * torch.randn(64, generator=g)).half()
    q = (torch.randn(6, 64, generator=g) * sharpness).half()
    policy = SketchTopK(coarse_factor=coarse_factor, min_candidates=0)  # two levels even on short contexts
    certified, true, _ = _certify(q, keys, block_tokens, budget, policy)
    _never_below(certified, true)


def _adversarial_block(q: torch.Tensor, low: torch.Tensor, high: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[16, D]: 9 tokens pin every channel's min and max while scoring low against q; the other 7 sit
    0.45 of a 4-bit step (0.5 less fp16 rounding) off their grid point in q's favour, on fine codes whose
    high plane alone is off by ~2 steps too (4 hi + 3 where q > 0, 4 hi + 4 where q < 0): the sketch
    underestimates each by 90% of its bound, and a bound 10% too tight fails this test."""
    head_dim = q.shape[0]
    up = q > 0
    floor = torch.where(up, low, high)  # the lowest-scoring corner of the box
    pins = [floor]
    for part in torch.arange(head_dim).chunk(4):
        for side in (up, ~up):  # the other extreme of a quarter of the channels, one token each
            pin = floor.clone()
            pin[part[side[part]]] = torch.where(up, high, low)[part[side[part]]]
            pins.append(pin)
    step = (high - low) / 15
    hi = torch.randint(0, 3, (7, head_dim), generator=g)
    grid = torch.where(up, 4 * hi + 3, 4 * hi + 4).float()
    return torch.cat((torch.stack(pins), low + step * (grid + 0.45 * torch.sign(q))))  # 0.45: robust to fp16


def test_certificate_holds_against_adversarial_keys() -> None:
    """Adversarial blocks (the sketch underestimates every free key by its whole error bound), norm-matched
    needles along the query, constant blocks (zero step), logits large enough to overflow a naive exp."""
    g = torch.Generator().manual_seed(1)
    head_dim, block_tokens = 64, 16
    q = torch.randn(head_dim, generator=g)
    blocks = []
    for _ in range(40):
        low, high = -1 - torch.rand(head_dim, generator=g), 1 + torch.rand(head_dim, generator=g)
        blocks.append(_adversarial_block(q, low, high, g))
    keys = torch.cat(blocks + [torch.randn(5, head_dim, generator=g)])  # [T, D], a partial tail block
    norm = keys.norm(dim=-1).mean()
    for pos in (100, 333, 500):
        keys[pos] = q / q.norm() * norm  # a needle: aligned, never extreme in any channel
    keys[16 * 20: 16 * 22] = 0.25  # two constant blocks
    for scale in (1.0, 8.0, 40.0):  # up to logits in the hundreds
        for budget in (64, 160, 320):
            for policy in (SketchTopK(), SketchTopK(min_candidates=0)):  # the full pass here, the two levels
                certified, true, _ = _certify((q * scale).half()[None], keys.half()[:, None], block_tokens, budget,
                                              policy)
                _never_below(certified, true)


def test_kernel_path_certifies_like_the_reference() -> None:
    g = torch.Generator().manual_seed(3)
    keys = (torch.randn(150, 1, 64, generator=g) * 2).half()
    q = (torch.randn(2, 64, generator=g) * 3).half()
    two_levels = dict(coarse_factor=2, min_candidates=0)
    got = _certify(q.to(DEVICE), keys.to(DEVICE), 16, 64, SketchTopK(**two_levels, use_kernel=True))
    want = _certify(q, keys, 16, 64, SketchTopK(**two_levels, use_kernel=False))
    assert torch.equal(got[2].cpu(), want[2])
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-4, atol=1e-6)
    _never_below(got[0].cpu(), got[1].cpu())


@pytest.mark.parametrize("num_blocks,k,group,spread", [(37, 5, 3, 4.0), (5000, 64, 4, 20.0), (300, 300, 1, 2.0),
                                                      (2100, 17, 2, 200.0)])
def test_one_launch_bound_matches_torch_and_is_never_below_it(num_blocks, k, group, spread) -> None:
    """certify_kernel.py's single pass against the torch form: dead blocks (-inf), bounds 200 nats apart (capped
    and underflowing terms), every block attended (k = N), two passes of its chunk (5000 > 2048)."""
    g = torch.Generator().manual_seed(num_blocks)
    heads = 2
    upper = torch.randn(heads * group, num_blocks, generator=g) * spread
    upper[:, ::7] = float("-inf")  # blocks outside the valid range
    selected = torch.stack([torch.randperm(num_blocks, generator=g)[:k] for _ in range(heads)])
    lse = torch.randn(heads * group, generator=g) * spread
    want = omitted_mass_bounds_ref(upper, selected, lse)
    got = omitted_mass_bounds_kernel(upper.to(DEVICE), selected.to(DEVICE), lse.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got >= want * (1 - 1e-6)).all() and (got <= 1).all()
    out = torch.full((heads * group,), float("nan"), device=DEVICE)
    assert omitted_mass_bounds(upper.to(DEVICE), selected.to(DEVICE), lse.to(DEVICE), out=out) is out
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-6)


def test_one_launch_bound_edges() -> None:
    """Nothing attended (L = -inf) and a live block left out: 1; every live block attended: ~0; a left-out block
    150 nats above L: 1."""
    upper = torch.tensor([[0.0, float("-inf"), 3.0], [float("-inf"), float("-inf"), 1.0]])
    selected = torch.tensor([[2], [2]])
    got = omitted_mass_bounds_kernel(upper.to(DEVICE), selected.to(DEVICE),
                                     torch.tensor([float("-inf"), 1.0], device=DEVICE)).cpu()
    assert got[0] == 1 and got[1] < 1e-14  # the fp64 rounding added back: (N + k + 2) 2^-52
    far = omitted_mass_bounds_kernel(torch.tensor([[150.0, 0.0]], device=DEVICE), torch.tensor([[1]], device=DEVICE),
                                     torch.tensor([0.0], device=DEVICE)).cpu()
    assert far[0] == 1
