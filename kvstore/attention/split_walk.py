"""The split walk of paged decode attention: flash-decoding split-K over a long block table.

Flash-decoding (Dao, Haziza, Massa, Sizov: "Flash-Decoding for long-context inference", 2023). Grid (batch,
kv_heads, num_splits): each program packs the q heads of one GQA group into the M dimension of tl.dot (padded to
>= 16) and walks a contiguous range of its row of entries, BLOCKS_PER_ITER blocks per iteration, dequantizing warm
blocks in registers (tiles.py; KIVI: K scaled per channel, V per token), and leaves its split's partial output and
log-sum-exp for merge.py. With both pools the table is partitioned per row (partition.py) and each pool's entries
get a launch of their own; int8 warm launches run in CUDA where int8_mma.usable. paged_decode.py calls it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcuda import nvrtc
from kvstore.attention import int8_mma
from kvstore.attention.merge import empty_partials, store_split
from kvstore.attention.partition import PartitionedTable, kept_or_new_partition
from kvstore.attention.plan import DecodeConfig, DecodeGeometry, WARM_INT8, scale_strides, use_asm
from kvstore.attention.tiles import entries, launch_dependents, load_kv_at, token_entries

# how paged_decode walks a table: "auto" (one_tile for a short table, else partition), one tile per program,
# or the split walk, which over two non-empty pools partitions the table, or fuses both pools' launches, or
# dispatches per split (over one pool the last three are the same direct walk)
WALKS = ("auto", "one_tile", "partition", "fused", "dispatch")


@triton.jit
def _attend(
    q, lse_rows, g_ok, slot_row, pos_row, is_int8_row, s_ent, s_i8_blk, lo, hi, n_tok, head, qk_scale,
    hot_ptr, warm_ptr, k_scale_ptr, v_scale_ptr,
    s_hot_slot, s_hot_kv, s_hot_head, s_hot_tok,
    s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok,
    s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
    HAS_HOT: tl.constexpr, HAS_WARM: tl.constexpr, PARTITIONED: tl.constexpr, RETURN_MASS: tl.constexpr,
    USE_ASM: tl.constexpr, WARM_FORMAT: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
):
    """Online softmax of q [M, D] over the row's entries [lo, hi): running max m, sum l [M] and acc [M, D].

    Scores are in the log2 domain. With RETURN_MASS, stores each block's log2-sum-exp2 at lse_rows + its
    position in the original table.
    """
    V_BOOST: tl.constexpr = 256.0  # p * v_scale * 256: out of fp16's subnormals, finite for v_scale < 256
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for j0 in range(lo, hi, BLOCKS_PER_ITER):
        tok_slot, tok_ok, tok_int8 = token_entries(slot_row, pos_row, is_int8_row, s_ent, s_i8_blk, j0, hi, n_tok,
                                                   BLOCK_TOKENS, BLOCKS_PER_ITER, HAS_HOT, HAS_WARM, PARTITIONED)
        k, v, v_mul = load_kv_at(
            hot_ptr, warm_ptr, k_scale_ptr, v_scale_ptr, slot_row, pos_row, is_int8_row, s_ent, s_i8_blk,
            j0, hi, n_tok, head, tok_slot, tok_ok, tok_int8,
            s_hot_slot, s_hot_kv, s_hot_head, s_hot_tok,
            s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok,
            s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
            HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER, HAS_HOT, HAS_WARM, PARTITIONED, USE_ASM, V_BOOST,
            WARM_FORMAT, K_GROUP, V_GROUP,
        )
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [M, N]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_WARM:
            acc = tl.dot((p * v_mul[None, :]).to(tl.float16), v, acc * alpha[:, None])  # V_BOOST x true acc
        else:
            acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None])
        m_i = m_new
        if RETURN_MASS:
            block_sum = tl.sum(tl.reshape(p, [GROUP_PAD, BLOCKS_PER_ITER, BLOCK_TOKENS]), 2)  # [M, J]
            block_lse = m_new[:, None] + tl.log2(tl.where(block_sum > 0, block_sum, 1.0))
            block_lse = tl.where(block_sum > 0, block_lse, float("-inf"))  # all of p underflowed
            _, pos, blk_ok = entries(slot_row, pos_row, s_ent, j0 + tl.arange(0, BLOCKS_PER_ITER), hi, PARTITIONED)
            tl.store(lse_rows[:, None] + pos[None, :], block_lse, mask=g_ok[:, None] & blk_ok[None, :])
    if HAS_WARM:
        acc = acc / V_BOOST
    return m_i, l_i, acc


@triton.jit
def _attend_one_pool(
    is_warm, args, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
    BLOCKS_PER_ITER: tl.constexpr, PARTITIONED: tl.constexpr, RETURN_MASS: tl.constexpr, USE_ASM: tl.constexpr,
    WARM_FORMAT: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
):
    """_attend(*args) over entries all of one pool: the warm one's loop where is_warm, else the hot one's (both
    compiled where is_warm is a runtime flag, one where it is a literal)."""
    if is_warm:
        m_i, l_i, acc = _attend(*args, GROUP_PAD, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER,
                                False, True, PARTITIONED, RETURN_MASS, USE_ASM, WARM_FORMAT, K_GROUP, V_GROUP)
    else:
        m_i, l_i, acc = _attend(*args, GROUP_PAD, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER,
                                True, False, PARTITIONED, RETURN_MASS, USE_ASM, WARM_FORMAT, K_GROUP, V_GROUP)
    return m_i, l_i, acc


@triton.jit
def _count_int8(is_int8_row, s_i8_blk, lo, hi, CHUNK: tl.constexpr):
    """How many of the table's blocks [lo, hi) are int8."""
    n = 0
    for j0 in range(lo, hi, CHUNK):
        blk = j0 + tl.arange(0, CHUNK)
        flags = tl.load(is_int8_row + blk * s_i8_blk, mask=blk < hi, other=0)
        n += tl.sum((flags != 0).to(tl.int32), 0)
    return n


@triton.jit
def _split_kernel(
    q_ptr, hot_ptr, warm_ptr, k_scale_ptr, v_scale_ptr, table_ptr, pos_ptr, is_int8_ptr, num_tokens_ptr,
    num_fp16_ptr, o_part_ptr, lse_part_ptr, lse_block_ptr,
    s_q_batch, s_q_head,
    s_hot_slot, s_hot_kv, s_hot_head, s_hot_tok,
    s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok,
    s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
    s_tab_batch, s_tab_head, s_tab_blk, s_i8_batch, s_i8_head, s_i8_blk, s_nf_batch, s_nf_head,
    qk_scale, blocks_per_split, pool_splits, split_base, num_splits, max_blocks, num_q_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
    HAS_HOT: tl.constexpr, HAS_WARM: tl.constexpr, PARTITIONED: tl.constexpr, RETURN_MASS: tl.constexpr,
    USE_ASM: tl.constexpr, TRIGGER: tl.constexpr, WARM_FORMAT: tl.constexpr, K_GROUP: tl.constexpr,
    V_GROUP: tl.constexpr,
):
    """Program (b, kv head, split): partial attention of the group's q heads over one range of entries.

    Direct (PARTITIONED false): table_ptr is the block table and split s walks its blocks
    [s * blocks_per_split, ...). With both pools, a split whose blocks are all fp16 or all int8 runs
    a loop specialised to that pool; mixed splits load from both.
    PARTITIONED: table_ptr / pos_ptr are partition.py's slots / positions; splits [0, pool_splits) share
    the row's fp16 entries, [pool_splits, 2 pool_splits) its int8 ones (split = split_base + program id;
    one launch per pool, or one for both when HAS_HOT and HAS_WARM). TRIGGER: the int8 launch after this one
    is programmatic (split_partials) and may start its programs as soon as these have all started.
    """
    if TRIGGER:
        launch_dependents()
    b = tl.program_id(0)
    head = tl.program_id(1)
    split = split_base + tl.program_id(2)
    n_tok = tl.load(num_tokens_ptr + b)
    n_blocks = tl.minimum(tl.cdiv(n_tok, BLOCK_TOKENS), max_blocks)
    if PARTITIONED:
        n_fp16 = tl.load(num_fp16_ptr + b * s_nf_batch + head * s_nf_head)
        is_warm = split >= pool_splits
        pool_lo = tl.where(is_warm, n_fp16, 0)
        pool_hi = tl.where(is_warm, n_blocks, n_fp16)
        per_split = tl.cdiv(tl.cdiv(pool_hi - pool_lo, pool_splits), BLOCKS_PER_ITER) * BLOCKS_PER_ITER
        lo = pool_lo + (split % pool_splits) * per_split
        hi = tl.minimum(lo + per_split, pool_hi)
    else:
        lo = split * blocks_per_split
        hi = tl.minimum(lo + blocks_per_split, n_blocks)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    g_ok = offs_g < GROUP
    q_head = head * GROUP + offs_g  # [M]
    q = tl.load(q_ptr + b * s_q_batch + q_head[:, None] * s_q_head + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    lse_rows = lse_block_ptr + (b * num_q_heads + q_head) * max_blocks  # [M] pointers
    slot_row = table_ptr + b * s_tab_batch + head * s_tab_head
    pos_row = pos_ptr + b * s_tab_batch + head * s_tab_head
    is_int8_row = is_int8_ptr + b * s_i8_batch + head * s_i8_head
    args = (
        q, lse_rows, g_ok, slot_row, pos_row, is_int8_row, s_tab_blk, s_i8_blk, lo, hi, n_tok, head, qk_scale,
        hot_ptr, warm_ptr, k_scale_ptr, v_scale_ptr,
        s_hot_slot, s_hot_kv, s_hot_head, s_hot_tok,
        s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok,
        s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
    )
    # constexprs spelled out at each call: a tuple of them compiles to tensors (the interpreter does not mind)
    if HAS_HOT and HAS_WARM:
        if PARTITIONED:
            m_i, l_i, acc = _attend_one_pool(is_warm, args, GROUP_PAD, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER,
                                             True, RETURN_MASS, USE_ASM, WARM_FORMAT, K_GROUP, V_GROUP)
        else:
            n_int8 = _count_int8(is_int8_row, s_i8_blk, lo, hi, 256)
            if n_int8 == 0:
                m_i, l_i, acc = _attend_one_pool(False, args, GROUP_PAD, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER,
                                                 False, RETURN_MASS, USE_ASM, WARM_FORMAT, K_GROUP, V_GROUP)
            elif n_int8 == hi - lo:
                m_i, l_i, acc = _attend_one_pool(True, args, GROUP_PAD, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER,
                                                 False, RETURN_MASS, USE_ASM, WARM_FORMAT, K_GROUP, V_GROUP)
            else:
                m_i, l_i, acc = _attend(*args, GROUP_PAD, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER,
                                        True, True, False, RETURN_MASS, USE_ASM, WARM_FORMAT, K_GROUP, V_GROUP)
    else:
        m_i, l_i, acc = _attend(*args, GROUP_PAD, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER,
                                HAS_HOT, HAS_WARM, PARTITIONED, RETURN_MASS, USE_ASM, WARM_FORMAT, K_GROUP, V_GROUP)
    part = (b * num_q_heads + q_head) * num_splits + split  # [M]
    store_split(o_part_ptr, lse_part_ptr, part, m_i, l_i, acc, g_ok, HEAD_DIM)


def split_partials(
    q: torch.Tensor, hot_pool: torch.Tensor, warm_words: torch.Tensor, warm_k_scale: torch.Tensor,
    warm_v_scale: torch.Tensor, block_table: torch.Tensor, block_is_int8: torch.Tensor, num_tokens: torch.Tensor,
    geom: DecodeGeometry, cfg: DecodeConfig, scale: float, return_block_mass: bool, walk: str,
    partition: PartitionedTable | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split walk (walk: partition, fused or dispatch): (o_part, lse_part, lse_block) as merge_splits reads
    them. Arguments as paged_decode checked them (warm_words: warm_data viewed as int32, flags as int8)."""
    has_hot, has_warm = hot_pool.shape[0] > 0, warm_words.shape[0] > 0
    partitioned = has_hot and has_warm and walk != "dispatch"
    total_splits = 2 * cfg.num_splits if partitioned else cfg.num_splits
    b, nq, h, d, max_blocks = geom.batch, geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.max_blocks
    o_part, lse_part, lse_block = empty_partials(geom, total_splits, return_block_mass, q.device)
    table, positions, num_fp16 = block_table, block_table, num_tokens[:, None].expand(b, h)  # direct: last 2 unused
    if partitioned:
        part = kept_or_new_partition(partition, block_table, block_is_int8, num_tokens, geom.block_tokens)
        table, positions, num_fp16 = part.slots, part.positions, part.num_fp16

    warm_bytes = warm_words.view(torch.int8)  # the CUDA walk reads the pool as bytes (int8 only: fp8, int4 take Triton)
    int8_cuda = has_warm and geom.warm_format == WARM_INT8 and \
        int8_mma.usable(q, warm_bytes, warm_k_scale, warm_v_scale, table, geom, scale)
    # the partition walk's int8 launch reads nothing its fp16 launch writes: it may overlap that one's last programs
    overlap = partitioned and walk == "partition" and int8_cuda and nvrtc.programmatic_launch_ok(q.device)

    def launch(split_base: int, grid_splits: int, hot: bool, warm: bool) -> None:
        if warm and not hot and int8_cuda:
            int8_mma.launch(q, warm_bytes, warm_k_scale, warm_v_scale, table, positions, num_tokens,
                            num_fp16, o_part, lse_part, lse_block, geom, cfg, scale, partitioned=partitioned,
                            split_base=split_base, grid_splits=grid_splits, total_splits=total_splits,
                            return_mass=return_block_mass, programmatic=overlap)
            return
        _split_kernel[(b, h, grid_splits)](
            q, hot_pool, warm_words, warm_k_scale, warm_v_scale, table, positions, block_is_int8, num_tokens,
            num_fp16, o_part, lse_part, lse_block,
            q.stride(0), q.stride(1),
            hot_pool.stride(0), hot_pool.stride(1), hot_pool.stride(2), hot_pool.stride(3),
            warm_words.stride(0), warm_words.stride(1), warm_words.stride(2), warm_words.stride(3),
            *scale_strides(warm_k_scale), *scale_strides(warm_v_scale),
            *table.stride(), *block_is_int8.stride(), *num_fp16.stride(),
            scale, cfg.blocks_per_split, cfg.num_splits, split_base, total_splits, max_blocks, nq,
            GROUP=geom.group, GROUP_PAD=max(16, triton.next_power_of_2(geom.group)), HEAD_DIM=d,
            BLOCK_TOKENS=geom.block_tokens, BLOCKS_PER_ITER=cfg.blocks_per_iter,
            HAS_HOT=hot, HAS_WARM=warm, PARTITIONED=partitioned, RETURN_MASS=return_block_mass,
            USE_ASM=use_asm(q.device), TRIGGER=overlap and hot, WARM_FORMAT=geom.warm_format,
            K_GROUP=max(1, geom.k_group), V_GROUP=max(1, geom.v_group), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    if partitioned and walk == "partition":
        launch(0, cfg.num_splits, True, False)  # the fp16 entries
        launch(cfg.num_splits, cfg.num_splits, False, True)  # the int8 entries
    else:
        launch(0, total_splits, has_hot, has_warm)
    return o_part, lse_part, lse_block
