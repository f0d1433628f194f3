"""Blocks ranked by their share of each head's estimated softmax, averaged over the GQA group (the sketch selector's
ranking: on real SmolLM2 Q/K ranking by estimated mass instead of the largest logit matters as much as the bits,
BENCHMARKS.md, Selection quality).

From per-(q head, block) log-sum-exps lse [Hq, N] of estimated logits: z_i = log sum_b exp(lse_ib) over the
ranked blocks and score_hb = mean over the group of exp(lse_ib - z_i). Blocks outside `valid` score -inf, kept
ones +inf, and a live block followed by a dead one (the tail: its codes may lag its keys) is left out of z and
scores 0 unless kept. Two launches on CUDA, each over (chunk of CHUNK blocks, kv head): per-chunk (max, sum)
partials, then z from them and the chunk's scores. z is returned too: the fine pass ranks its candidates with it
(eviction/sketch_kernel.py refine_candidates).

Layout: kernels -> launcher -> pure-torch reference. Imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024  # blocks per program


@triton.jit
def _ranked(lse_ptr, valid_ptr, chunk, head, num_blocks, stride_lh,
            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, CHUNK: tl.constexpr, HAS_VALID: tl.constexpr):
    """(lse [GROUP_PAD, CHUNK] with unranked entries -inf, offs [CHUNK], live [CHUNK], tail [CHUNK])."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    offs_g = tl.arange(0, GROUP_PAD)
    inside = offs < num_blocks
    if HAS_VALID:
        live = inside & (tl.load(valid_ptr + offs, mask=inside, other=0) != 0)
        after = (offs + 1 < num_blocks) & (tl.load(valid_ptr + offs + 1, mask=offs + 1 < num_blocks, other=0) != 0)
    else:
        live = inside
        after = offs + 1 < num_blocks
    tail = live & ~after
    ranked = live & ~tail
    mask = (offs_g < GROUP)[:, None] & ranked[None, :]
    lse = tl.load(lse_ptr + (head * GROUP + offs_g)[:, None] * stride_lh + offs[None, :], mask=mask,
                  other=float("-inf"))
    return tl.where(mask, lse, float("-inf")), offs, live, tail


@triton.jit
def _partials_kernel(lse_ptr, valid_ptr, part_max_ptr, part_sum_ptr, num_blocks, stride_lh, stride_ph,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, CHUNK: tl.constexpr, HAS_VALID: tl.constexpr):
    chunk, head = tl.program_id(0), tl.program_id(1)
    lse, _, _, _ = _ranked(lse_ptr, valid_ptr, chunk, head, num_blocks, stride_lh, GROUP, GROUP_PAD, CHUNK, HAS_VALID)
    top = tl.max(lse, 1)  # [GROUP_PAD]
    safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(lse - safe[:, None]), 1)
    offs_g = tl.arange(0, GROUP_PAD)
    out = (head * GROUP + offs_g) * stride_ph + chunk
    tl.store(part_max_ptr + out, top, mask=offs_g < GROUP)
    tl.store(part_sum_ptr + out, total, mask=offs_g < GROUP)


@triton.jit
def _shares_kernel(lse_ptr, valid_ptr, keep_ptr, part_max_ptr, part_sum_ptr, scores_ptr, z_ptr, num_blocks,
                   num_chunks, stride_lh, stride_ph, stride_sh,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr,
                   HAS_VALID: tl.constexpr):
    chunk, head = tl.program_id(0), tl.program_id(1)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_p = tl.arange(0, CHUNKS_PAD)
    g_ok = offs_g < GROUP
    parts = (head * GROUP + offs_g)[:, None] * stride_ph + offs_p[None, :]
    p_ok = g_ok[:, None] & (offs_p < num_chunks)[None, :]
    part_max = tl.load(part_max_ptr + parts, mask=p_ok, other=float("-inf"))  # [GROUP_PAD, CHUNKS_PAD]
    part_sum = tl.load(part_sum_ptr + parts, mask=p_ok, other=0.0)
    top = tl.max(part_max, 1)
    safe = tl.where(top == float("-inf"), 0.0, top)
    scaled = tl.where(part_max == float("-inf"), 0.0, part_sum * tl.exp(part_max - safe[:, None]))
    z = safe + tl.log(tl.sum(scaled, 1))  # [GROUP_PAD]; -inf when nothing is ranked
    if chunk == 0:
        tl.store(z_ptr + head * GROUP + offs_g, z, mask=g_ok)
    lse, offs, live, tail = _ranked(lse_ptr, valid_ptr, chunk, head, num_blocks, stride_lh, GROUP, GROUP_PAD,
                                    CHUNK, HAS_VALID)
    z_safe = tl.where(z == float("-inf"), float("inf"), z)  # nothing ranked: every share 0
    share = tl.sum(tl.where(g_ok[:, None], tl.exp(lse - z_safe[:, None]), 0.0), 0) / GROUP  # [CHUNK]
    kept = tl.load(keep_ptr + offs, mask=offs < num_blocks, other=0) != 0
    score = tl.where(live, tl.where(kept, float("inf"), tl.where(tail, 0.0, share)), float("-inf"))
    tl.store(scores_ptr + head * stride_sh + offs, score, mask=offs < num_blocks)


def _check(lse: torch.Tensor, keep: torch.Tensor, valid: torch.Tensor | None, num_kv_heads: int) -> None:
    if lse.dim() != 2 or lse.dtype != torch.float32 or lse.shape[0] % num_kv_heads:
        raise ValueError(f"lse: expected float32 [a multiple of {num_kv_heads}, N], got {lse.dtype} {list(lse.shape)}")
    for name, mask in (("keep", keep), ("valid", valid)):
        if mask is not None and (mask.shape != (lse.shape[1],) or mask.dtype != torch.bool):
            raise ValueError(f"{name}: expected bool [{lse.shape[1]}], got {mask.dtype} {list(mask.shape)}")


def block_shares(lse: torch.Tensor, keep: torch.Tensor, valid: torch.Tensor | None,
                 num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores float32 [H, N], z float32 [Hq]) from lse float32 [Hq, N] (module docstring); keep, valid bool [N]
    (valid None: every block). Sync-free."""
    _check(lse, keep, valid, num_kv_heads)
    num_q_heads, num_blocks = lse.shape
    group = num_q_heads // num_kv_heads
    chunks = triton.cdiv(num_blocks, CHUNK)
    part_max = torch.empty(num_q_heads, chunks, dtype=torch.float32, device=lse.device)  # [Hq, P]
    part_sum = torch.empty_like(part_max)
    scores = torch.empty(num_kv_heads, num_blocks, dtype=torch.float32, device=lse.device)  # [H, N]
    z = torch.empty(num_q_heads, dtype=torch.float32, device=lse.device)
    valid_arg = keep if valid is None else valid
    meta = dict(GROUP=group, GROUP_PAD=triton.next_power_of_2(group), CHUNK=CHUNK, HAS_VALID=valid is not None)
    _partials_kernel[(chunks, num_kv_heads)](lse, valid_arg, part_max, part_sum, num_blocks, lse.stride(0),
                                             part_max.stride(0), **meta, num_warps=4)
    _shares_kernel[(chunks, num_kv_heads)](lse, valid_arg, keep, part_max, part_sum, scores, z, num_blocks, chunks,
                                           lse.stride(0), part_max.stride(0), scores.stride(0),
                                           CHUNKS_PAD=triton.next_power_of_2(chunks), **meta, num_warps=4)
    return scores, z


def block_shares_ref(lse: torch.Tensor, keep: torch.Tensor, valid: torch.Tensor | None,
                     num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `block_shares`; also the CPU path."""
    _check(lse, keep, valid, num_kv_heads)
    live = torch.ones_like(keep) if valid is None else valid
    tail = live & ~torch.cat((live[1:], live.new_zeros(1)))
    ranked = lse.masked_fill(~(live & ~tail), float("-inf"))
    z = torch.logsumexp(ranked, dim=1)  # [Hq]
    share = torch.exp(ranked - z.masked_fill(z == float("-inf"), float("inf"))[:, None])
    share = share.view(num_kv_heads, -1, lse.shape[1]).mean(1)  # [H, N]
    scores = torch.where(keep, float("inf"), share.masked_fill(tail, 0.0)).masked_fill(~live, float("-inf"))
    return scores, z
