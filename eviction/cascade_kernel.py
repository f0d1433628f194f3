"""The cascade's candidate ranking in one launch (eviction/cascade.py `_rerank`, its torch reference).

Per kv head (one program): each candidate's share of each q head's softmax over the counted candidates (live,
not the tail: its codes are written once it fills), averaged over the GQA group; protected candidates (bound
+inf) rank +inf, dead ones (bound -inf) -inf. In torch that is ~10 launches of a few microseconds each in every
layer of a captured token; the top-k after it is topk_kernel.topk_gather_table (one launch, block table
included).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shares_kernel(lse_ptr, s_lse, bound_ptr, s_bound, cand_ptr, s_cand, tail_ptr, out_ptr, s_out, c,
                   GROUP: tl.constexpr, BLOCK: tl.constexpr):
    head = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    valid = offs < c
    cand = tl.load(cand_ptr + head * s_cand + offs, mask=valid, other=0)
    bound = tl.load(bound_ptr + head * s_bound + cand, mask=valid, other=float("-inf"))
    counted = valid & (bound > float("-inf")) & (cand != tl.load(tail_ptr))
    share = tl.zeros([BLOCK], tl.float32)
    for g in tl.static_range(GROUP):
        x = tl.load(lse_ptr + (head * GROUP + g) * s_lse + offs, mask=counted, other=float("-inf"))
        m = tl.max(x, 0)
        e = tl.where(counted, tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), 0.0)
        z = tl.sum(e, 0)
        share += tl.where(z > 0, e / z, 0.0)
    ranked = tl.where(bound == float("inf"), float("inf"), share / GROUP)
    ranked = tl.where(valid & (bound > float("-inf")), ranked, float("-inf"))
    tl.store(out_ptr + head * s_out + offs, ranked, mask=valid)


def candidate_shares(lse: torch.Tensor, bound: torch.Tensor, candidates: torch.Tensor,
                     tail: torch.Tensor) -> torch.Tensor:
    """float32 [H, C] ranking of the candidates: lse float32 [Hq, C] (4-bit log-sum-exp per q head and
    candidate), bound float32 [H, N] (Quest's, +inf protected, -inf not live), candidates int64 [H, C], tail
    int64 [1]."""
    heads, c = candidates.shape
    if lse.shape[1] != c or lse.shape[0] % heads or bound.shape[0] != heads or tail.numel() != 1:
        raise ValueError(f"candidate_shares: lse [Hq, {c}], bound [{heads}, N] and tail [1] expected, got "
                         f"{list(lse.shape)}, {list(bound.shape)}, {list(tail.shape)}")
    out = torch.empty((heads, c), dtype=torch.float32, device=lse.device)
    block = max(triton.next_power_of_2(c), 16)
    _shares_kernel[(heads,)](lse, lse.stride(0), bound, bound.stride(0), candidates, candidates.stride(0), tail, out,
                             out.stride(0), c, GROUP=lse.shape[0] // heads, BLOCK=block,
                             num_warps=4 if block <= 1024 else 8)
    return out


def candidate_shares_ref(lse: torch.Tensor, bound: torch.Tensor, candidates: torch.Tensor,
                         tail: torch.Tensor) -> torch.Tensor:
    """`candidate_shares` in torch."""
    heads = candidates.shape[0]
    group = lse.shape[0] // heads
    picked = bound.gather(1, candidates)
    counted = (picked > float("-inf")) & (candidates != tail)  # [H, C]
    lse = lse.masked_fill(~counted.repeat_interleave(group, dim=0), float("-inf"))
    share = torch.softmax(lse, dim=1).view(heads, group, -1).mean(1).nan_to_num(0.0)  # [H, C]
    ranked = torch.where(picked == float("inf"), float("inf"), share)
    return ranked.masked_fill(picked == float("-inf"), float("-inf"))
