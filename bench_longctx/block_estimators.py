"""The block estimators bench_longctx/selection_quality.py compares beside the policies: Quest's bound, 4-bit and
2-bit key codes (largest logit or softmax mass per block), 1-bit codes of rotated keys (RaBitQ's estimator, raw or
centred on each block's mean key), SparQ, Loki and block centroids (BENCHMARKS.md, Estimators).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eviction.quest_kernel import quest_scores_ref
from eviction.select import cdiv
from eviction.sketch import sketch_keys, token_estimates_ref

RANK = 16  # SparQ channels / Loki dimensions: 16 of 64, the bytes of the 4-bit sketch in fp16


def blocks_of(x: torch.Tensor, block_tokens: int, fill: float) -> torch.Tensor:
    """[..., T] -> [..., N, B], padded with `fill`."""
    n = cdiv(x.shape[-1], block_tokens)
    return torch.nn.functional.pad(x, (0, n * block_tokens - x.shape[-1]), value=fill).unflatten(-1, (n, block_tokens))


def estimate_to_blocks(est: torch.Tensor, num_kv_heads: int, block_tokens: int, reduce: str) -> torch.Tensor:
    """Token logit estimates [Hq, T] -> block scores [H, N]: max over tokens and group heads, or the
    estimated softmax mass per block (group mean)."""
    if reduce == "max":
        per_head = blocks_of(est, block_tokens, float("-inf")).amax(-1)  # [Hq, N]
        return per_head.unflatten(0, (num_kv_heads, -1)).amax(1)
    per_head = blocks_of(torch.softmax(est, dim=-1), block_tokens, 0.0).sum(-1)
    return per_head.unflatten(0, (num_kv_heads, -1)).mean(1)


def scorers(rank: int = RANK) -> dict[str, Callable]:
    """name -> f(q [Hq, D] fp16, keys [T, H, D] fp16, block_tokens, scale) -> block scores [H, N]."""
    def quest(q, keys, b, scale):
        from eviction.summaries import summarize_keys
        return quest_scores_ref(q, summarize_keys(keys, b))

    def sketch(planes, reduce):
        def f(q, keys, b, scale):
            summaries, codes = sketch_keys(keys, b)
            est, _ = token_estimates_ref(q, summaries, codes, planes)  # [Hq, N, B]
            est = est.flatten(1)[:, : keys.shape[0]] * scale
            return estimate_to_blocks(est, keys.shape[1], b, reduce)
        return f

    def exact_subset(project):
        def f(q, keys, b, scale):
            h = keys.shape[1]
            qg = q.float().view(h, -1, q.shape[-1])  # [H, G, D]
            est = torch.einsum("hgd,thd->hgt", *project(qg, keys.float())).flatten(0, 1) * scale  # [Hq, T]
            return estimate_to_blocks(est, h, b, "max")
        return f

    def sparq(qg, k):  # the `rank` channels of largest |q| summed over the group (SparQ, Ribar et al. 2024)
        idx = qg.abs().sum(1).topk(rank, dim=-1).indices  # [H, r]
        return (torch.gather(qg, 2, idx[:, None].expand(-1, qg.shape[1], -1)),
                torch.gather(k, 2, idx[None].expand(k.shape[0], -1, -1)))

    def loki(qg, k):  # top principal directions of this layer-head's keys (Loki, Singhania et al. 2024)
        basis = torch.linalg.eigh(torch.einsum("thd,the->hde", k, k) / k.shape[0]).eigenvectors[..., -rank:]
        return qg @ basis, torch.einsum("thd,hdr->thr", k, basis)

    def centroid(q, keys, b, scale):
        h = keys.shape[1]
        return torch.bmm(q.float().view(h, -1, q.shape[-1]), block_means(keys, b)).amax(1)

    def signs(centered):
        def f(q, keys, b, scale):
            return estimate_to_blocks(sign_estimates(q, keys, b, centered) * scale, keys.shape[1], b, "mass")
        return f

    return {"quest": quest, "sketch4": sketch(2, "max"), "sketch4_mass": sketch(2, "mass"),
            "sketch2": sketch(1, "max"), "sketch2_mass": sketch(1, "mass"), "sparq16": exact_subset(sparq),
            "loki16": exact_subset(loki), "centroid": centroid, "sign1_mass": signs(False),
            "sign1_centered_mass": signs(True)}


def block_means(keys: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """Each block's mean key, float32 [H, D, N], from keys [T, H, D] (a partial last block over its own tokens)."""
    sums = blocks_of(keys.float().permute(1, 2, 0), block_tokens, 0.0).sum(-1)  # [H, D, N]
    return sums / blocks_of(torch.ones(keys.shape[0], device=keys.device), block_tokens, 0.0).sum(-1)


def sign_estimates(q: torch.Tensor, keys: torch.Tensor, block_tokens: int, centered: bool) -> torch.Tensor:
    """Estimated logits q . k [Hq, T] (unscaled) from 1-bit codes of randomly rotated keys and RaBitQ's unbiased
    estimator (Gao & Long, 2024): per token the signs of R (k - c) / |k - c| (D bits), |k - c| and <x_bar, x>
    (fp16 each; x the rotated unit residual, x_bar its signs / sqrt(D)); q . k ~ q . c + |k - c| <R q, x_bar> /
    <x_bar, x>. centered: c is the token's block's mean key (fp16 per block), else 0. R: one seeded random
    orthogonal matrix per kv head."""
    t, h, d = keys.shape
    k = keys.float()
    center = torch.zeros_like(k)
    if centered:
        means = block_means(keys, block_tokens).half().float()  # [H, D, N], kept fp16
        center = means.repeat_interleave(block_tokens, dim=2)[..., :t].permute(2, 0, 1)
    r = k - center  # [T, H, D]
    norm = r.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    rot = torch.linalg.qr(torch.randn(h, d, d, generator=torch.Generator().manual_seed(0)))[0].to(k.device)
    x = torch.einsum("thd,hed->the", r / norm, rot)  # unit residuals, rotated
    bits = torch.where(x >= 0, 1.0, -1.0) / d ** 0.5
    inner = (bits * x).sum(-1, keepdim=True).half().float()  # sum |x| / sqrt(D): 0 only for no residual
    factor = torch.where(inner > 0, norm.half().float() / inner, 0.0).squeeze(-1).T  # [H, T]
    qg = q.float().view(h, -1, d)  # [H, G, D]
    est = torch.einsum("hgd,thd->hgt", qg, center) + \
        torch.einsum("hge,the->hgt", torch.einsum("hgd,hed->hge", qg, rot), bits) * factor[:, None]
    return est.flatten(0, 1)
