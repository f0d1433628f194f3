"""Pure-torch reference for kvstore.attention.paged_decode.paged_decode.

Gathers each row's blocks per kv head, dequantizes warm blocks (tiers/quant.py: int8, fp8 or int4),
and runs plain fp32 softmax attention. Slow (Python loop over rows and kv heads); it is
the definition the kernel is tested against, not a fallback. merge_splits_ref: what merge.py computes.
"""

from __future__ import annotations

import math

import torch

from kvstore.attention.append import NewToken, append_token_ref
from kvstore.attention.plan import check_append, check_decode_inputs, check_lse_target, check_mass_target
from tiers.layout import QuantBlocks
from tiers.quant import dequantize


def gather_kv(
    hot_pool: torch.Tensor, warm_data: torch.Tensor, warm_k_scale: torch.Tensor, warm_v_scale: torch.Tensor,
    slots: torch.Tensor, is_int8: torch.Tensor, head: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one kv head over the blocks `slots` (int [n]), float32 [n * block_tokens, head_dim] each."""
    n, block_tokens, head_dim = slots.numel(), hot_pool.shape[3], hot_pool.shape[4]
    k = torch.empty((n, block_tokens, head_dim), dtype=torch.float32, device=hot_pool.device)  # [n, T, D]
    v = torch.empty_like(k)
    hot_ids, warm_ids = slots[~is_int8].long(), slots[is_int8].long()
    k[~is_int8] = hot_pool[hot_ids, 0, head].float()
    v[~is_int8] = hot_pool[hot_ids, 1, head].float()
    warm = dequantize(QuantBlocks(warm_data[warm_ids], warm_k_scale[warm_ids], warm_v_scale[warm_ids]), torch.float32)
    k[is_int8] = warm[:, 0, head]  # [m, T, D], in the warm pool's format (tiers/quant.py)
    v[is_int8] = warm[:, 1, head]
    return k.reshape(-1, head_dim), v.reshape(-1, head_dim)


def paged_decode_ref(
    q: torch.Tensor, hot_pool: torch.Tensor, warm_data: torch.Tensor, warm_k_scale: torch.Tensor,
    warm_v_scale: torch.Tensor, block_table: torch.Tensor, block_is_int8: torch.Tensor, num_tokens: torch.Tensor,
    *, sm_scale: float | None = None, return_block_mass: bool = False, num_splits: int | None = None,
    add_mass_to: tuple[torch.Tensor, torch.Tensor] | None = None, lse_out: torch.Tensor | None = None,
    append: NewToken | None = None, partition: object = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as paged_decode (num_splits and partition, a launch plan, are accepted and ignored)."""
    geom = check_decode_inputs(q, hot_pool, warm_data, warm_k_scale, warm_v_scale, block_table, block_is_int8,
                               num_tokens)
    check_mass_target(add_mass_to, geom, q.device)
    check_lse_target(lse_out, geom, q.device)
    check_append(append, geom, hot_pool)
    if append is not None:
        append_token_ref(hot_pool, append.summaries, append.k, append.v, append.tail_slot, append.count)
    if lse_out is not None:
        lse_out.fill_(float("-inf"))  # rows without tokens
    group, block_tokens = geom.group, geom.block_tokens
    scale = sm_scale if sm_scale is not None else geom.head_dim**-0.5
    out = torch.zeros_like(q)  # [B, Hq, D]
    mass = torch.zeros(block_table.shape, dtype=torch.float32, device=q.device)  # [B, H, max_blocks]
    for b in range(geom.batch):
        n = int(num_tokens[b])
        n_blocks = -(-n // block_tokens)
        if n == 0:
            continue
        for h in range(geom.num_kv_heads):
            slots, is_int8 = block_table[b, h, :n_blocks], block_is_int8[b, h, :n_blocks].bool()
            k, v = gather_kv(hot_pool, warm_data, warm_k_scale, warm_v_scale, slots, is_int8, h)
            q_group = q[b, h * group : (h + 1) * group].float()  # [G, D]
            logits = q_group @ k[:n].T * scale  # [G, n]
            p = torch.softmax(logits, dim=-1)
            if lse_out is not None:
                lse_out[b, h * group : (h + 1) * group] = torch.logsumexp(logits, dim=-1)
            out[b, h * group : (h + 1) * group] = (p @ v[:n]).half()
            p_blocks = torch.nn.functional.pad(p, (0, n_blocks * block_tokens - n))  # [G, n_blocks * T]
            mass[b, h, :n_blocks] = p_blocks.view(group, n_blocks, block_tokens).sum(-1).mean(0)
    if add_mass_to is not None:  # the row's live blocks only (entries past them are not read)
        scores, index = add_mass_to
        n_blocks = -(-int(num_tokens[0]) // block_tokens)
        scores.scatter_add_(1, index[:, :n_blocks], mass[0, :, :n_blocks])
    return out, (mass if return_block_mass else None)


def merge_splits_ref(
    o_part: torch.Tensor, lse_part: torch.Tensor, lse_block: torch.Tensor, num_tokens: torch.Tensor,
    block_tokens: int, num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What merge.merge_splits computes (with block mass), in torch: base-2 log-sum-exps throughout.

    o_part f32 [B, Hq, S, D], lse_part f32 [B, Hq, S] (-inf: an empty split), lse_block f32 [B, Hq, M]
    -> (out fp16 [B, Hq, D], mass f32 [B, H, M]: 0 past each row's blocks)."""
    batch, num_q_heads, _, _ = o_part.shape
    lse = torch.logsumexp(lse_part.double() * math.log(2), -1) / math.log(2)  # [B, Hq]
    w = torch.exp2(lse_part.double() - lse[..., None]).nan_to_num(0.0)  # rows with no tokens: 0
    out = (w[..., None] * o_part.double()).sum(-2).half()
    n_blocks = (num_tokens.long() + block_tokens - 1) // block_tokens  # [B]
    used = torch.arange(lse_block.shape[-1], device=lse_block.device)[None, :] < n_blocks[:, None]  # [B, M]
    mass = torch.where(used[:, None], torch.exp2(lse_block.double() - lse[..., None]), 0.0)  # [B, Hq, M]
    mass = mass.view(batch, num_kv_heads, num_q_heads // num_kv_heads, -1).mean(2)
    return out, mass.float()
