"""Paged decode attention over a block table that mixes fp16 (hot) and int8 (warm) blocks.

Flash-decoding split-K (Dao, Haziza, Massa, Sizov: "Flash-Decoding for long-context
inference", 2023). Grid (batch, kv_heads, num_splits): each program packs the q heads of
one GQA group into the M dimension of tl.dot (padded to >= 16) and walks a contiguous
range of its row of the block table, BLOCKS_PER_ITER blocks per iteration, dequantizing
int8 blocks in registers (KIVI: K scaled per channel, V per token). The splits are merged,
and per-block log-sums turned into block mass for H2O, in merge.py.

Memory read: tiers/layout.py. Reference: reference.py. Config: plan.py.
All log-sum-exps here are base 2 (scores are pre-multiplied by log2(e)).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvstore.attention.merge import merge_splits
from kvstore.attention.plan import check_decode_inputs, check_kernel_layout, decode_config

LOG2E = 1.4426950408889634


@triton.jit
def _byte_to_fp16(words, k: tl.constexpr):
    """Byte k of each int32 word, read as int8, to fp16: fp16 bits 0x64 | (x + 128) are 1152 + x."""
    bits = (((words >> (8 * k)) & 0xFF) ^ 0x6480).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def _words_to_fp16(words, USE_ASM: tl.constexpr):
    """int32 [..., W] of packed int8 (4 per word, memory order) -> fp16 [..., W, 2, 2], exactly.

    No I2F (quarter rate on sm_90): USE_ASM does a word with one xor, two prmt and two packed
    subs; the plain form is for the interpreter, which cannot run PTX.
    """
    if USE_ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, c, lo, hi;
            xor.b32 t, $4, 0x80808080;
            mov.b32 c, 0x64806480;
            prmt.b32 lo, t, 0x64646464, 0x4140;
            prmt.b32 hi, t, 0x64646464, 0x4342;
            sub.f16x2 lo, lo, c;
            sub.f16x2 hi, hi, c;
            mov.b32 {$0, $1}, lo;
            mov.b32 {$2, $3}, hi;
            }""",
            constraints="=h,=h,=h,=h,r", args=[words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1,
        )
    else:
        b0 = _byte_to_fp16(words, 0)
        b1 = _byte_to_fp16(words, 1)
        b2 = _byte_to_fp16(words, 2)
        b3 = _byte_to_fp16(words, 3)
    return tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [..., W, 2, 2]: [..., w, i, j] = byte 2 i + j of word w


@triton.jit
def _load_int8_k(
    warm_ptr, k_scale_ptr, table_row, is_int8_row, s_tab_blk, s_i8_blk, j0, blk_hi, tok_hi, head,
    s_warm_slot, s_warm_head, s_warm_tok, s_ks_slot, s_ks_head,
    HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
    CHECK_FLAGS: tl.constexpr, USE_ASM: tl.constexpr,
):
    """Dequantized K of the int8 blocks among j0 .. j0 + BLOCKS_PER_ITER, fp16 [N, D], 0 elsewhere.

    K's scale is per (block, channel), so K is loaded per block and the scale broadcasts over its
    tokens. It is applied in fp16: exact to rounding unless a channel's absmax is < 2^-7 (scale in
    fp16's subnormals), where the channel adds next to nothing to q.k anyway.
    """
    blk = j0 + tl.arange(0, BLOCKS_PER_ITER)  # [J]
    slot = tl.load(table_row + blk * s_tab_blk, mask=blk < blk_hi, other=0).to(tl.int64)
    is_int8 = blk < blk_hi
    if CHECK_FLAGS:
        is_int8 &= tl.load(is_int8_row + blk * s_i8_blk, mask=blk < blk_hi, other=0) != 0
    offs_t = tl.arange(0, BLOCK_TOKENS)
    offs_w = tl.arange(0, HEAD_DIM // 4)
    mask = (blk[:, None] * BLOCK_TOKENS + offs_t[None, :] < tok_hi) & is_int8[:, None]  # [J, T]
    base = slot * s_warm_slot + head * s_warm_head  # [J] int64
    ptrs = warm_ptr + base[:, None, None] + offs_t[None, :, None] * s_warm_tok + offs_w[None, None, :]
    k = _words_to_fp16(tl.load(ptrs, mask=mask[:, :, None], other=0), USE_ASM)
    k = tl.reshape(k, [BLOCKS_PER_ITER, BLOCK_TOKENS, HEAD_DIM])
    ks_ptrs = k_scale_ptr + (slot * s_ks_slot + head * s_ks_head)[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    k_scale = tl.load(ks_ptrs, mask=is_int8[:, None], other=0.0).to(tl.float16)  # [J, D]
    return tl.reshape(k * k_scale[:, None, :], [BLOCKS_PER_ITER * BLOCK_TOKENS, HEAD_DIM])


@triton.jit
def _load_kv(
    hot_ptr, warm_ptr, k_scale_ptr, v_scale_ptr, table_row, is_int8_row, s_tab_blk, s_i8_blk,
    j0, blk_hi, tok_hi, head,
    s_hot_slot, s_hot_kv, s_hot_head, s_hot_tok,
    s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok,
    s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
    HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
    HAS_HOT: tl.constexpr, HAS_WARM: tl.constexpr, USE_ASM: tl.constexpr, V_BOOST: tl.constexpr,
):
    """Blocks j0 .. j0 + BLOCKS_PER_ITER of one kv head: k, v fp16 [N, D] (0 past tok_hi) and v_mul f32 [N].

    K = k. V = v * v_mul / V_BOOST: int8 blocks keep their integer values in v and their per-token
    scale in v_mul, which the caller folds into the probabilities (fp16 blocks: v_mul = V_BOOST).
    The boost keeps p * v_scale out of fp16's subnormals. Without HAS_WARM v_mul is unused.
    """
    n: tl.constexpr = BLOCKS_PER_ITER * BLOCK_TOKENS
    offs_n = tl.arange(0, n)
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.zeros([n, HEAD_DIM], tl.float16)
    v = tl.zeros([n, HEAD_DIM], tl.float16)
    v_mul = tl.full([n], V_BOOST, tl.float32)
    tok_ok = j0 * BLOCK_TOKENS + offs_n < tok_hi  # [N]
    tok_blk = j0 + offs_n // BLOCK_TOKENS
    tok_slot = tl.load(table_row + tok_blk * s_tab_blk, mask=tok_ok, other=0).to(tl.int64)
    tok_in_blk = offs_n % BLOCK_TOKENS
    hot_ok = tok_ok  # a pure build trusts that every flag names its pool
    warm_ok = tok_ok
    if HAS_HOT and HAS_WARM:
        tok_int8 = tl.load(is_int8_row + tok_blk * s_i8_blk, mask=tok_ok, other=0) != 0
        hot_ok = tok_ok & (tok_int8 == 0)
        warm_ok = tok_ok & tok_int8
    if HAS_HOT:
        rows = tok_slot * s_hot_slot + head * s_hot_head + tok_in_blk * s_hot_tok  # [N] int64
        ptrs = hot_ptr + rows[:, None] + offs_d[None, :]  # [N, D]
        k = tl.load(ptrs, mask=hot_ok[:, None], other=0.0)
        v = tl.load(ptrs + s_hot_kv, mask=hot_ok[:, None], other=0.0)
    if HAS_WARM:
        offs_w = tl.arange(0, HEAD_DIM // 4)
        rows = tok_slot * s_warm_slot + head * s_warm_head + tok_in_blk * s_warm_tok  # [N] int64
        v8 = tl.load(warm_ptr + s_warm_kv + rows[:, None] + offs_w[None, :], mask=warm_ok[:, None], other=0)
        v8 = tl.reshape(_words_to_fp16(v8, USE_ASM), [n, HEAD_DIM])
        vs_ptrs = v_scale_ptr + tok_slot * s_vs_slot + head * s_vs_head + tok_in_blk
        v_mul = tl.where(warm_ok, tl.load(vs_ptrs, mask=warm_ok, other=0.0), tok_ok.to(tl.float32)) * V_BOOST
        k8 = _load_int8_k(
            warm_ptr, k_scale_ptr, table_row, is_int8_row, s_tab_blk, s_i8_blk, j0, blk_hi, tok_hi, head,
            s_warm_slot, s_warm_head, s_warm_tok, s_ks_slot, s_ks_head,
            HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER, HAS_HOT, USE_ASM,
        )
        if HAS_HOT:
            k += k8  # each element comes from one pool; the other load gave 0
            v += v8
        else:
            k = k8
            v = v8
    return k, v, v_mul


@triton.jit
def _attend(
    q, lse_rows, g_ok, table_row, is_int8_row, s_tab_blk, s_i8_blk, blk_lo, blk_hi, tok_hi, head, qk_scale,
    hot_ptr, warm_ptr, k_scale_ptr, v_scale_ptr,
    s_hot_slot, s_hot_kv, s_hot_head, s_hot_tok,
    s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok,
    s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
    HAS_HOT: tl.constexpr, HAS_WARM: tl.constexpr, RETURN_MASS: tl.constexpr, USE_ASM: tl.constexpr,
):
    """Online softmax of q [M, D] over table blocks [blk_lo, blk_hi): running max m, sum l [M] and acc [M, D].

    Scores are in the log2 domain. With RETURN_MASS, stores each block's log2-sum-exp2 at lse_rows + block.
    """
    V_BOOST: tl.constexpr = 256.0  # p * v_scale * 256: out of fp16's subnormals, finite for v_scale < 256
    offs_n = tl.arange(0, BLOCKS_PER_ITER * BLOCK_TOKENS)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for j0 in range(blk_lo, blk_hi, BLOCKS_PER_ITER):
        k, v, v_mul = _load_kv(
            hot_ptr, warm_ptr, k_scale_ptr, v_scale_ptr, table_row, is_int8_row, s_tab_blk, s_i8_blk,
            j0, blk_hi, tok_hi, head,
            s_hot_slot, s_hot_kv, s_hot_head, s_hot_tok,
            s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok,
            s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
            HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER, HAS_HOT, HAS_WARM, USE_ASM, V_BOOST,
        )
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [M, N]
        s = tl.where((j0 * BLOCK_TOKENS + offs_n)[None, :] < tok_hi, s, float("-inf"))
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
            blk = j0 + tl.arange(0, BLOCKS_PER_ITER)
            tl.store(lse_rows[:, None] + blk[None, :], block_lse, mask=g_ok[:, None] & (blk < blk_hi)[None, :])
    if HAS_WARM:
        acc = acc / V_BOOST
    return m_i, l_i, acc


@triton.jit
def _count_int8(is_int8_row, s_i8_blk, blk_lo, blk_hi, CHUNK: tl.constexpr):
    """How many of the blocks [blk_lo, blk_hi) are int8."""
    n = 0
    for j0 in range(blk_lo, blk_hi, CHUNK):
        blk = j0 + tl.arange(0, CHUNK)
        flags = tl.load(is_int8_row + blk * s_i8_blk, mask=blk < blk_hi, other=0)
        n += tl.sum((flags != 0).to(tl.int32), 0)
    return n


@triton.jit
def _split_kernel(
    q_ptr, hot_ptr, warm_ptr, k_scale_ptr, v_scale_ptr, table_ptr, is_int8_ptr, num_tokens_ptr,
    o_part_ptr, lse_part_ptr, lse_block_ptr,
    s_q_batch, s_q_head,
    s_hot_slot, s_hot_kv, s_hot_head, s_hot_tok,
    s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok,
    s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
    s_tab_batch, s_tab_head, s_tab_blk, s_i8_batch, s_i8_head, s_i8_blk,
    qk_scale, blocks_per_split, num_splits, max_blocks, num_q_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
    HAS_HOT: tl.constexpr, HAS_WARM: tl.constexpr, RETURN_MASS: tl.constexpr, USE_ASM: tl.constexpr,
):
    """Program (b, kv head, split): partial attention of the group's q heads over one range of blocks.

    With both pools, a split whose blocks are all fp16 or all int8 runs a loop specialized for
    that pool; only truly mixed splits pay for loading from both.
    """
    b = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    n_tok = tl.load(num_tokens_ptr + b)
    blk_lo = split * blocks_per_split
    blk_hi = tl.minimum(blk_lo + blocks_per_split, tl.cdiv(n_tok, BLOCK_TOKENS))
    tok_hi = tl.minimum(n_tok, blk_hi * BLOCK_TOKENS)  # tokens past this belong to others or to nobody

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    g_ok = offs_g < GROUP
    q_head = head * GROUP + offs_g  # [M]
    q = tl.load(q_ptr + b * s_q_batch + q_head[:, None] * s_q_head + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    lse_rows = lse_block_ptr + (b * num_q_heads + q_head) * max_blocks  # [M] pointers
    table_row = table_ptr + b * s_tab_batch + head * s_tab_head
    is_int8_row = is_int8_ptr + b * s_i8_batch + head * s_i8_head
    args = (
        q, lse_rows, g_ok, table_row, is_int8_row, s_tab_blk, s_i8_blk, blk_lo, blk_hi, tok_hi, head, qk_scale,
        hot_ptr, warm_ptr, k_scale_ptr, v_scale_ptr,
        s_hot_slot, s_hot_kv, s_hot_head, s_hot_tok,
        s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok,
        s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
    )
    if HAS_HOT and HAS_WARM:
        n_int8 = _count_int8(is_int8_row, s_i8_blk, blk_lo, blk_hi, 256)
        if n_int8 == 0:
            m_i, l_i, acc = _attend(
                *args, GROUP_PAD, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER, True, False, RETURN_MASS, USE_ASM)
        elif n_int8 == blk_hi - blk_lo:
            m_i, l_i, acc = _attend(
                *args, GROUP_PAD, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER, False, True, RETURN_MASS, USE_ASM)
        else:
            m_i, l_i, acc = _attend(
                *args, GROUP_PAD, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER, True, True, RETURN_MASS, USE_ASM)
    else:
        m_i, l_i, acc = _attend(
            *args, GROUP_PAD, HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER, HAS_HOT, HAS_WARM, RETURN_MASS, USE_ASM)

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # 0 only for a split past the row's end
    part = (b * num_q_heads + q_head) * num_splits + split  # [M]
    tl.store(o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None], mask=g_ok[:, None])
    tl.store(lse_part_ptr + part, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=g_ok)


def _use_asm(device: torch.device) -> bool:
    """Inline PTX only on a real CUDA launch; the interpreter runs the plain-Triton twin."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")


def paged_decode(
    q: torch.Tensor, hot_pool: torch.Tensor, warm_data: torch.Tensor, warm_k_scale: torch.Tensor,
    warm_v_scale: torch.Tensor, block_table: torch.Tensor, block_is_int8: torch.Tensor, num_tokens: torch.Tensor,
    *, sm_scale: float | None = None, return_block_mass: bool = False, num_splits: int | None = None,
    blocks_per_iter: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode step of attention over paged KV: returns (out fp16 [B, Hq, D], block_mass f32 [B, H, max_blocks]).

    q: fp16 [B, Hq, D]. hot_pool: fp16 [n_hot, 2, H, T, D]. warm_data: int8 [n_warm, 2, H, T, D] with
    warm_k_scale f32 [n_warm, H, D] and warm_v_scale f32 [n_warm, H, T]. block_table: int32 [B, H, max_blocks]
    slot ids per kv head (stride 0 over H is fine); block_is_int8: bool/int8, same shape, True -> warm pool.
    num_tokens: int32 [B]; row b uses its first ceil(num_tokens[b] / T) table entries. A row with no tokens
    gets zeros. block_mass (if asked): softmax mass per block averaged over each group's q heads.
    The last four kwargs override the tile/split config (see decode_config) for benchmarks.
    """
    geom = check_decode_inputs(q, hot_pool, warm_data, warm_k_scale, warm_v_scale, block_table, block_is_int8,
                               num_tokens)
    check_kernel_layout(q, hot_pool, warm_data, warm_k_scale, warm_v_scale)
    has_hot, has_warm = hot_pool.shape[0] > 0, warm_data.shape[0] > 0
    cfg = decode_config(geom, q.device, num_splits=num_splits, blocks_per_iter=blocks_per_iter,
                        num_warps=num_warps, num_stages=num_stages)
    if block_is_int8.dtype == torch.bool:
        block_is_int8 = block_is_int8.view(torch.int8)  # same bytes; keeps expanded strides
    b, nq, h, d, max_blocks = geom.batch, geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.max_blocks
    dev, f32 = q.device, torch.float32
    o_part = torch.empty((b, nq, cfg.num_splits, d), dtype=f32, device=dev)  # [B, Hq, S, D]
    lse_part = torch.empty((b, nq, cfg.num_splits), dtype=f32, device=dev)  # [B, Hq, S]
    lse_block = torch.empty((b, nq, max_blocks) if return_block_mass else (1,), dtype=f32, device=dev)
    scale = (sm_scale if sm_scale is not None else d**-0.5) * LOG2E
    warm_words = warm_data.view(torch.int32)  # [n_warm, 2, H, T, D / 4]: 4 int8 per word
    _split_kernel[(b, h, cfg.num_splits)](
        q, hot_pool, warm_words, warm_k_scale, warm_v_scale, block_table, block_is_int8, num_tokens,
        o_part, lse_part, lse_block,
        q.stride(0), q.stride(1),
        hot_pool.stride(0), hot_pool.stride(1), hot_pool.stride(2), hot_pool.stride(3),
        warm_words.stride(0), warm_words.stride(1), warm_words.stride(2), warm_words.stride(3),
        warm_k_scale.stride(0), warm_k_scale.stride(1), warm_v_scale.stride(0), warm_v_scale.stride(1),
        *block_table.stride(), *block_is_int8.stride(),
        scale, cfg.blocks_per_split, cfg.num_splits, max_blocks, nq,
        GROUP=geom.group, GROUP_PAD=max(16, triton.next_power_of_2(geom.group)), HEAD_DIM=d,
        BLOCK_TOKENS=geom.block_tokens, BLOCKS_PER_ITER=cfg.blocks_per_iter,
        HAS_HOT=has_hot, HAS_WARM=has_warm, RETURN_MASS=return_block_mass, USE_ASM=_use_asm(q.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return merge_splits(o_part, lse_part, lse_block, num_tokens, geom, return_block_mass)
