"""A certified upper bound on the softmax mass a sparse decode step left out.

For q head i, let A be the attended blocks and U_ib >= log sum_{t in b} exp(l_it) an upper
bound on each unattended block's log-sum-exp of true logits (eviction/sketch_kernel.py:
the sketch estimate plus its rounding bound, or the min/max bound, whichever is tighter).
With L_i = log sum_{t in A} exp(l_it) exact (the attention kernel's log-sum-exp), the mass
left out is
    m_i = S / (exp(L_i) + S),  S = sum_{b not in A} sum_t exp(l_it) <= S_hat = sum_{b not in A} exp(U_ib),
and x / (c + x) grows with x, so m_i <= S_hat / (exp(L_i) + S_hat) = sigmoid(lse_b U_ib - L_i).
A kv head reports the mean over its GQA group (the store's mass is a group mean, too).
The attention output's error is at most 2 m_i max_t ||v_t|| (the omitted part and the
renormalization), so epsilon bounds the output error as well.
"""

from __future__ import annotations

import torch

from eviction.certify_kernel import omitted_mass_bounds_kernel


def unselected_mask(selected: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """bool [H, num_blocks]: True for blocks a row of selected [H, k] does not hold."""
    mask = torch.ones(selected.shape[0], num_blocks, dtype=torch.bool, device=selected.device)
    return mask.scatter_(1, selected, False)


def certified_omitted_mass(block_upper: torch.Tensor, selected: torch.Tensor,
                           attended_lse: torch.Tensor) -> torch.Tensor:
    """float32 [H]: per kv head, the group mean of an upper bound on each q head's omitted softmax mass.

    block_upper: float32 [Hq, N] upper bounds on each block's log-sum-exp of logits (only unselected
    columns are read); selected: int64 [H, k] attended blocks (distinct per row); attended_lse: float32 [Hq]
    exact log-sum-exp of the logits over the attended tokens. Same scale (softmax scale applied) everywhere.
    """
    bounds = omitted_mass_bounds(block_upper, selected, attended_lse)
    return bounds.view(selected.shape[0], -1).mean(1)


def omitted_mass_bounds(block_upper: torch.Tensor, selected: torch.Tensor, attended_lse: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [Hq]: per q head, the upper bound on its omitted softmax mass (certified_omitted_mass's inputs),
    written into out (float32 [Hq]) when given: one launch on CUDA (eviction/certify_kernel.py), else
    omitted_mass_bounds_ref."""
    num_q_heads, num_blocks = block_upper.shape
    num_kv_heads = selected.shape[0]
    if num_q_heads % num_kv_heads or attended_lse.shape != (num_q_heads,):
        raise ValueError(f"block_upper [Hq, N], selected [H, k], attended_lse [Hq] with Hq % H == 0; got "
                         f"{list(block_upper.shape)}, {list(selected.shape)}, {list(attended_lse.shape)}")
    if block_upper.is_cuda:
        return omitted_mass_bounds_kernel(block_upper.float(), selected, attended_lse.float(), out)
    bounds = omitted_mass_bounds_ref(block_upper, selected, attended_lse)
    return bounds if out is None else out.copy_(bounds)


def omitted_mass_bounds_ref(block_upper: torch.Tensor, selected: torch.Tensor,
                            attended_lse: torch.Tensor) -> torch.Tensor:
    """Pure-torch form of omitted_mass_bounds: the masked log-sum-exp of the left-out blocks' bounds, then
    sigmoid(that - L) (module docstring)."""
    num_q_heads, num_blocks = block_upper.shape
    left_out = unselected_mask(selected, num_blocks).repeat_interleave(num_q_heads // selected.shape[0], dim=0)
    omitted = torch.logsumexp(block_upper.float().masked_fill(~left_out, float("-inf")), dim=1)  # [Hq]
    return torch.sigmoid(omitted - attended_lse.float())  # -inf (nothing left out) -> 0


def true_omitted_mass(logits: torch.Tensor, selected: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """float32 [H]: per kv head, the group mean of the softmax mass outside the selected blocks.

    logits: [Hq, T] true (scaled) logits of every token; selected: int64 [H, k].
    """
    num_q_heads, num_tokens = logits.shape
    num_kv_heads = selected.shape[0]
    token_block = torch.arange(num_tokens, device=logits.device) // block_tokens  # [T]
    num_blocks = int(token_block[-1]) + 1
    left_out = unselected_mask(selected, num_blocks)[:, token_block]  # [H, T]
    p = torch.softmax(logits.float(), dim=1).view(num_kv_heads, -1, num_tokens)
    return (p * left_out[:, None]).sum(-1).mean(1)


def attended_lse(logits: torch.Tensor, selected: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """float32 [Hq]: log-sum-exp of logits [Hq, T] over the tokens of the selected blocks [H, k]
    (what the attention kernel reports; this is its reference for tests and benchmarks)."""
    num_q_heads, num_tokens = logits.shape
    token_block = torch.arange(num_tokens, device=logits.device) // block_tokens
    left_out = unselected_mask(selected, int(token_block[-1]) + 1)[:, token_block]  # [H, T]
    left_out = left_out.repeat_interleave(num_q_heads // selected.shape[0], dim=0)
    return torch.logsumexp(logits.float().masked_fill(left_out, float("-inf")), dim=1)
