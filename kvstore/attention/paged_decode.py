"""Paged decode attention over a block table that mixes fp16 (hot) and quantized (warm: int8, fp8 or int4) blocks.

paged_decode, the one entry of every walk: it checks the inputs, picks the walk and its config (plan.py), and merges
the walk's splits, turning per-block log-sums into block mass for H2O, in merge.py (one launch).

A short table (a top-k budget) takes the one-tile walk (one_tile.py): one launch, then the merge.
A long one takes the split walk (split_walk.py). With one pool, the row is the block table and the loop is
specialised to that pool. With both (what the captured decode step always passes), the table is
partitioned per row on the device (partition.py) and each pool's entries get a launch of their own
(int8 at int8 cost, fp16 at fp16 cost; on sm_90 the int8 one starts as the fp16 one's programs end; int8 warm
launches run in CUDA where int8_mma.usable, fp8 and int4 ones always in Triton),
whatever the mix; the per-split dispatch stays selectable (walk="dispatch") for the benchmark.
Memory read: tiers/layout.py. Reference: reference.py. Config: plan.py. Log-sum-exps are base 2.
"""

from __future__ import annotations

import torch

from kvstore.attention.append import NewToken, append_token
from kvstore.attention.merge import merge_splits
from kvstore.attention.one_tile import one_tile_partials
from kvstore.attention.partition import PartitionedTable
from kvstore.attention.plan import (check_append, check_decode_inputs, check_kernel_layout, check_lse_target,
                                   check_mass_target, decode_config, use_asm)
from kvstore.attention.split_walk import WALKS, split_partials

LOG2E = 1.4426950408889634


def paged_decode(
    q: torch.Tensor, hot_pool: torch.Tensor, warm_data: torch.Tensor, warm_k_scale: torch.Tensor,
    warm_v_scale: torch.Tensor, block_table: torch.Tensor, block_is_int8: torch.Tensor, num_tokens: torch.Tensor,
    *, sm_scale: float | None = None, return_block_mass: bool = False, num_splits: int | None = None,
    blocks_per_iter: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    walk: str = "auto", add_mass_to: tuple[torch.Tensor, torch.Tensor] | None = None,
    lse_out: torch.Tensor | None = None, append: NewToken | None = None, partition: PartitionedTable | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode step of attention over paged KV: returns (out fp16 [B, Hq, D], block_mass f32 [B, H, max_blocks]).

    q: fp16 [B, Hq, D]. hot_pool: fp16 [n_hot, 2, H, T, D]. warm_data: int8 [n_warm, 2, H, T, D] with
    warm_k_scale f32 [n_warm, H, D] and warm_v_scale f32 [n_warm, H, T]. block_table: int32 [B, H, max_blocks]
    slot ids per kv head (stride 0 over H is fine); block_is_int8: bool, or int8 read as nonzero, same shape,
    True -> warm pool. num_tokens: int32 [B]; row b uses its first ceil(num_tokens[b] / T) table entries. A row
    with no tokens gets zeros. block_mass (if asked): softmax mass per block averaged over each group's q heads.
    num_splits, blocks_per_iter, num_warps, num_stages override the config (see decode_config; a forced
    num_splits takes the split walk); with both pools num_splits is per pool. walk: one of WALKS.
    lse_out: f32 [B, Hq], filled with each q head's log-sum-exp of its scaled logits over the row's tokens
    (natural log, -inf for a row without tokens; the merge has it anyway): what a bound on omitted mass needs.
    append (batch 1; append.py): the new token, stored in the hot pool before it is attended as the row's last
    token (num_tokens counts it): inside the one-tile launch, or by append_token before the split walk.
    partition: partition_table(block_table, block_is_int8, num_tokens, T) made earlier (the table unchanged
    since): the partition walk reads it instead of partitioning the table again (kvstore/decode/dense_tables.py).
    """
    geom = check_decode_inputs(q, hot_pool, warm_data, warm_k_scale, warm_v_scale, block_table, block_is_int8,
                               num_tokens)
    check_kernel_layout(q, hot_pool, warm_data, warm_k_scale, warm_v_scale)
    if walk not in WALKS:
        raise ValueError(f"walk: expected one of {WALKS}, got {walk!r}")
    check_mass_target(add_mass_to, geom, q.device)
    check_lse_target(lse_out, geom, q.device)
    check_append(append, geom, hot_pool)
    with_mass = return_block_mass or add_mass_to is not None
    cfg = decode_config(geom, q.device, num_splits=num_splits, blocks_per_iter=blocks_per_iter,
                        num_warps=num_warps, num_stages=num_stages,
                        one_tile=None if walk == "auto" else walk == "one_tile")
    if block_is_int8.dtype == torch.bool:
        block_is_int8 = block_is_int8.view(torch.int8)  # same bytes; keeps expanded strides
    scale = (sm_scale if sm_scale is not None else geom.head_dim**-0.5) * LOG2E
    # [n_warm, 2, H, T, D / 4] words of 4 int8 or e4m3 values, or [n_warm, 2, H, T, D / 8] of 8 int4 codes
    warm_words = warm_data.view(torch.int32)
    args = (q, hot_pool, warm_words, warm_k_scale, warm_v_scale, block_table, block_is_int8, num_tokens)
    if cfg.one_tile:
        parts = one_tile_partials(*args, geom, cfg, scale, with_mass, use_asm(q.device), append)
    else:
        if append is not None:
            append_token(hot_pool, append.summaries, append.k, append.v, append.tail_slot, append.count)
        parts = split_partials(*args, geom, cfg, scale, with_mass, "partition" if walk == "auto" else walk, partition)
    return merge_splits(*parts, num_tokens, geom, return_block_mass, add_mass_to, lse_out)
