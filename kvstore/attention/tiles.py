"""One tile of K/V for the paged decode kernel: table entries -> slots, fp16 rows, warm rows dequantized.

A row of entries is either the block table itself (direct) or partition.py's list of (slot, position in
the table) with one pool's blocks in a run. int8 -> fp16 happens in registers, 4 packed int8 per int32
word, exactly, without I2F (quarter rate on sm_90): fp16 with bits 0x64 | (x + 128) is 1152 + x, so a
byte becomes fp16 by an xor, a byte permute and one subtraction. USE_ASM does a word with one xor, two
prmt and two packed subs; the plain-Triton form is for the interpreter, which cannot run PTX.
The other warm formats (WARM_FORMAT, plan.py) are read as int32 words too and decoded with integer ops,
exactly, two values a 32-bit op with USE_ASM: fp8 (e4m3 bits, fp16 bits (b & 0x80) << 8 | (b & 0x7F) << 7
are the value / 256) and int4 (a nibble x as fp16 bits 0x6400 | x is 1024 + x; (scale, zero) in fp16 per K
group of K_GROUP tokens and V group of V_GROUP channels, tiers/quant.py, each loaded once per group and
broadcast in registers).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _byte_to_fp16(words, k: tl.constexpr):
    """Byte k of each int32 word, read as int8, to fp16: fp16 bits 0x64 | (x + 128) are 1152 + x."""
    bits = (((words >> (8 * k)) & 0xFF) ^ 0x6480).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def words_to_fp16(words, USE_ASM: tl.constexpr):
    """int32 [..., W] of packed int8 (4 per word, memory order) -> fp16 [..., W, 2, 2], exactly."""
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
def _fp8_byte_to_fp16(words, k: tl.constexpr):
    """Byte k of each int32 word, e4m3 bits, to fp16: fp16 bits (b & 0x80) << 8 | (b & 0x7F) << 7 are the
    value / 256 (e4m3's subnormals land in fp16's, exactly)."""
    b = (words >> (8 * k)) & 0xFF
    bits = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def fp8_words_to_fp16(words, USE_ASM: tl.constexpr):
    """int32 [..., W] of packed e4m3 (4 per word, memory order) -> fp16 [..., W, 2, 2], exactly. USE_ASM: per
    pair of bytes one prmt (each byte to the top of a 16-bit half), a shift and two masks put e4m3's sign,
    exponent and mantissa where fp16's are, and one packed multiply by 256 rebiases the exponent."""
    if USE_ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 x, y, s, lo, hi, c, m;
            mov.b32 c, 0x5C005C00;
            mov.b32 m, 0x3F803F80;
            prmt.b32 x, $4, 0, 0x1404;
            shr.b32 y, x, 1;
            and.b32 s, x, 0x80008000;
            lop3.b32 lo, y, m, s, 0xEA;
            mul.f16x2 lo, lo, c;
            prmt.b32 x, $4, 0, 0x3424;
            shr.b32 y, x, 1;
            and.b32 s, x, 0x80008000;
            lop3.b32 hi, y, m, s, 0xEA;
            mul.f16x2 hi, hi, c;
            mov.b32 {$0, $1}, lo;
            mov.b32 {$2, $3}, hi;
            }""",
            constraints="=h,=h,=h,=h,r", args=[words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1,
        )
    else:
        b0 = _fp8_byte_to_fp16(words, 0)
        b1 = _fp8_byte_to_fp16(words, 1)
        b2 = _fp8_byte_to_fp16(words, 2)
        b3 = _fp8_byte_to_fp16(words, 3)
    return tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [..., W, 2, 2]: [..., w, i, j] = byte 2 i + j of word w


@triton.jit
def _nibble_to_fp16(words, c: tl.constexpr):
    """Code c (bits 4c .. 4c + 3) of each int32 word to fp16: fp16 bits 0x6400 | x are 1024 + x."""
    return (((words >> (4 * c)) & 0xF) | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def nibble_words_to_fp16(words, USE_ASM: tl.constexpr):
    """int32 [..., W] of packed 4-bit codes (8 per word; channel 2j low, 2j + 1 high in byte j, so channel c of
    a word is its bits 4c .. 4c + 3) -> fp16 codes [..., W, 2, 2, 2], exactly. USE_ASM: channels c and c + 4
    are one mask-and-or (lop3) and one packed subtraction of 1024 away from an fp16 pair."""
    if USE_ASM:
        c0, c4, c1, c5, c2, c6, c3, c7 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, r0, r1, r2, r3, c, m;
            mov.b32 c, 0x64006400;
            mov.b32 m, 0x000F000F;
            lop3.b32 r0, $8, m, c, 0xEA;
            shr.b32 t, $8, 4;
            lop3.b32 r1, t, m, c, 0xEA;
            shr.b32 t, $8, 8;
            lop3.b32 r2, t, m, c, 0xEA;
            shr.b32 t, $8, 12;
            lop3.b32 r3, t, m, c, 0xEA;
            sub.f16x2 r0, r0, c;
            sub.f16x2 r1, r1, c;
            sub.f16x2 r2, r2, c;
            sub.f16x2 r3, r3, c;
            mov.b32 {$0, $1}, r0;
            mov.b32 {$2, $3}, r1;
            mov.b32 {$4, $5}, r2;
            mov.b32 {$6, $7}, r3;
            }""",
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r", args=[words], dtype=(tl.float16,) * 8, is_pure=True, pack=1,
        )
    else:
        c0 = _nibble_to_fp16(words, 0)
        c1 = _nibble_to_fp16(words, 1)
        c2 = _nibble_to_fp16(words, 2)
        c3 = _nibble_to_fp16(words, 3)
        c4 = _nibble_to_fp16(words, 4)
        c5 = _nibble_to_fp16(words, 5)
        c6 = _nibble_to_fp16(words, 6)
        c7 = _nibble_to_fp16(words, 7)
    # [..., w, i, j, l] = channel 4 i + 2 j + l of word w: the innermost join is the most significant bit
    return tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))


@triton.jit
def launch_dependents():
    """griddepcontrol.launch_dependents (sm_90+): a kernel launched programmatically after this one may start its
    programs once every program of this one has run this (or ended). A no-op for launches that are not."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def entries(slot_row, pos_row, s_ent, idx, idx_hi, PARTITIONED: tl.constexpr):
    """Entries idx (any shape) of a row: slot int64, position in the original table, and idx < idx_hi.

    Direct: the row is the block table, position = idx. Partitioned: the row is partition.py's list.
    """
    ok = idx < idx_hi
    slot = tl.load(slot_row + idx * s_ent, mask=ok, other=0).to(tl.int64)
    if PARTITIONED:
        pos = tl.load(pos_row + idx * s_ent, mask=ok, other=0)
    else:
        pos = idx
    return slot, pos, ok


@triton.jit
def load_warm_k(
    warm_ptr, k_scale_ptr, slot_row, pos_row, is_int8_row, s_ent, s_i8_blk, j0, idx_hi, n_tok, head,
    s_warm_slot, s_warm_head, s_warm_tok, s_ks_slot, s_ks_head,
    HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
    CHECK_FLAGS: tl.constexpr, PARTITIONED: tl.constexpr, USE_ASM: tl.constexpr,
    WARM_FORMAT: tl.constexpr, K_GROUP: tl.constexpr,
):
    """Dequantized K of the warm blocks among entries j0 .. j0 + BLOCKS_PER_ITER, fp16 [N, D], 0 in other entries.

    int8 / fp8: K's scale is per (block, channel), so K is loaded per block and the scale broadcasts over its
    tokens. It is applied in fp16: exact to rounding unless a channel's absmax is < 2^-7 (scale in
    fp16's subnormals), where the channel adds next to nothing to q.k anyway. int4: code * scale + zero per
    (block, group of K_GROUP tokens, channel), in fp16.
    """
    blk = j0 + tl.arange(0, BLOCKS_PER_ITER)  # [J]
    slot, pos, is_int8 = entries(slot_row, pos_row, s_ent, blk, idx_hi, PARTITIONED)
    if CHECK_FLAGS:
        is_int8 &= tl.load(is_int8_row + blk * s_i8_blk, mask=blk < idx_hi, other=0) != 0
    offs_t = tl.arange(0, BLOCK_TOKENS)
    offs_d = tl.arange(0, HEAD_DIM)
    n: tl.constexpr = BLOCKS_PER_ITER * BLOCK_TOKENS
    mask = (pos[:, None] * BLOCK_TOKENS + offs_t[None, :] < n_tok) & is_int8[:, None]  # [J, T]
    base = slot * s_warm_slot + head * s_warm_head  # [J] int64
    rows = base[:, None, None] + offs_t[None, :, None] * s_warm_tok  # [J, T, 1]
    ks_row = k_scale_ptr + (slot * s_ks_slot + head * s_ks_head)[:, None]  # [J, 1]
    if WARM_FORMAT == 2:  # int4: 8 codes a word; (scale, zero) per token group, the zeros half a slot after
        offs_w = tl.arange(0, HEAD_DIM // 8)
        codes = tl.load(warm_ptr + rows + offs_w[None, None, :], mask=mask[:, :, None], other=0)
        groups: tl.constexpr = BLOCK_TOKENS // K_GROUP  # each (scale, zero) read once, broadcast over its tokens
        k = tl.reshape(nibble_words_to_fp16(codes, USE_ASM), [BLOCKS_PER_ITER, groups, BLOCK_TOKENS // groups,
                                                                HEAD_DIM])
        ptrs = ks_row[:, :, None] + tl.arange(0, groups)[None, :, None] * HEAD_DIM + offs_d[None, None, :]
        k_scale = tl.load(ptrs, mask=is_int8[:, None, None], other=0.0)  # [J, G, D]
        k_zero = tl.load(ptrs + s_ks_slot // 2, mask=is_int8[:, None, None], other=0.0)
        # tokens past n_tok in a warm block read code 0 (= k_zero): finite, and the caller masks their scores
        return tl.reshape(k * k_scale[:, :, None, :] + k_zero[:, :, None, :], [n, HEAD_DIM])
    offs_w = tl.arange(0, HEAD_DIM // 4)
    words = tl.load(warm_ptr + rows + offs_w[None, None, :], mask=mask[:, :, None], other=0)
    if WARM_FORMAT == 1:  # fp8: 4 e4m3 a word
        k = fp8_words_to_fp16(words, USE_ASM)
    else:  # int8: 4 bytes a word
        k = words_to_fp16(words, USE_ASM)
    k = tl.reshape(k, [BLOCKS_PER_ITER, BLOCK_TOKENS, HEAD_DIM])
    k_scale = tl.load(ks_row + offs_d[None, :], mask=is_int8[:, None], other=0.0).to(tl.float16)  # [J, D]
    return tl.reshape(k * k_scale[:, None, :], [n, HEAD_DIM])


@triton.jit
def token_entries(
    slot_row, pos_row, is_int8_row, s_ent, s_i8_blk, j0, idx_hi, n_tok,
    BLOCK_TOKENS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr, HAS_HOT: tl.constexpr, HAS_WARM: tl.constexpr,
    PARTITIONED: tl.constexpr,
):
    """Per token of entries j0 .. j0 + BLOCKS_PER_ITER, what load_kv_at takes: slot int64 [N], tok_ok [N] (the
    entry is below idx_hi and the token one of the row's first n_tok) and tok_int8 [N] (read only with both pools:
    else tok_ok)."""
    n: tl.constexpr = BLOCKS_PER_ITER * BLOCK_TOKENS
    offs_n = tl.arange(0, n)
    tok_idx = j0 + offs_n // BLOCK_TOKENS
    tok_slot, tok_pos, tok_ok = entries(slot_row, pos_row, s_ent, tok_idx, idx_hi, PARTITIONED)
    tok_ok &= tok_pos * BLOCK_TOKENS + offs_n % BLOCK_TOKENS < n_tok  # [N]
    tok_int8 = tok_ok
    if HAS_HOT and HAS_WARM:
        tok_int8 = tl.load(is_int8_row + tok_idx * s_i8_blk, mask=tok_ok, other=0) != 0
    return tok_slot, tok_ok, tok_int8


@triton.jit
def load_kv_at(
    hot_ptr, warm_ptr, k_scale_ptr, v_scale_ptr, slot_row, pos_row, is_int8_row, s_ent, s_i8_blk,
    j0, idx_hi, n_tok, head, tok_slot, tok_ok, tok_int8,
    s_hot_slot, s_hot_kv, s_hot_head, s_hot_tok,
    s_warm_slot, s_warm_kv, s_warm_head, s_warm_tok,
    s_ks_slot, s_ks_head, s_vs_slot, s_vs_head,
    HEAD_DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
    HAS_HOT: tl.constexpr, HAS_WARM: tl.constexpr, PARTITIONED: tl.constexpr, USE_ASM: tl.constexpr,
    V_BOOST: tl.constexpr, WARM_FORMAT: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
):
    """Entries j0 .. j0 + BLOCKS_PER_ITER of one kv head, given their per-token slot int64 [N], tok_ok [N] and
    tok_int8 [N] (read only with both pools; token_entries, or loads a caller issues before it knows the row's
    length): k, v fp16 [N, D] (0 where tok_ok is not) and v_mul f32 [N].

    K = k. V = v * v_mul / V_BOOST: int8 (fp8) blocks keep their integer (e4m3) values in v and their per-token
    scale in v_mul, which the caller folds into the probabilities (fp16 and int4 blocks: v_mul = V_BOOST, int4's
    V dequantized here: its (scale, zero) vary along the channels).
    The boost keeps p * v_scale out of fp16's subnormals. Without HAS_WARM v_mul is unused.
    The per-block entries (int8 K's slots and scales) are loaded here, bounded by idx_hi; they hit the
    cache lines the per-token ones brought in.
    """
    n: tl.constexpr = BLOCKS_PER_ITER * BLOCK_TOKENS
    offs_d = tl.arange(0, HEAD_DIM)
    tok_in_blk = tl.arange(0, n) % BLOCK_TOKENS
    k = tl.zeros([n, HEAD_DIM], tl.float16)
    v = tl.zeros([n, HEAD_DIM], tl.float16)
    v_mul = tl.full([n], V_BOOST, tl.float32)
    hot_ok = tok_ok  # a pure build trusts that every flag names its pool
    warm_ok = tok_ok
    if HAS_HOT and HAS_WARM:
        hot_ok = tok_ok & (tok_int8 == 0)
        warm_ok = tok_ok & tok_int8
    if HAS_HOT:
        rows = tok_slot * s_hot_slot + head * s_hot_head + tok_in_blk * s_hot_tok  # [N] int64
        ptrs = hot_ptr + rows[:, None] + offs_d[None, :]  # [N, D]
        k = tl.load(ptrs, mask=hot_ok[:, None], other=0.0)
        v = tl.load(ptrs + s_hot_kv, mask=hot_ok[:, None], other=0.0)
    if HAS_WARM:
        rows = tok_slot * s_warm_slot + head * s_warm_head + tok_in_blk * s_warm_tok  # [N] int64
        if WARM_FORMAT == 2:  # int4: V = code * scale + zero per (token, group of V_GROUP channels)
            groups: tl.constexpr = HEAD_DIM // V_GROUP
            codes = tl.load(warm_ptr + s_warm_kv + rows[:, None] + tl.arange(0, HEAD_DIM // 8)[None, :],
                            mask=warm_ok[:, None], other=0)
            vs_ptrs = v_scale_ptr + (tok_slot * s_vs_slot + head * s_vs_head + tok_in_blk * groups)[:, None] + \
                tl.arange(0, groups)[None, :]  # [N, G]: each scale read once and broadcast over its channels
            v_scale = tl.load(vs_ptrs, mask=warm_ok[:, None], other=0.0)
            v_zero = tl.load(vs_ptrs + s_vs_slot // 2, mask=warm_ok[:, None], other=0.0)
            v8 = tl.reshape(nibble_words_to_fp16(codes, USE_ASM), [n, groups, V_GROUP])
            v8 = tl.reshape(v8 * v_scale[:, :, None] + v_zero[:, :, None], [n, HEAD_DIM])
        else:
            offs_w = tl.arange(0, HEAD_DIM // 4)
            v8 = tl.load(warm_ptr + s_warm_kv + rows[:, None] + offs_w[None, :], mask=warm_ok[:, None], other=0)
            if WARM_FORMAT == 1:  # fp8
                v8 = tl.reshape(fp8_words_to_fp16(v8, USE_ASM), [n, HEAD_DIM])
            else:
                v8 = tl.reshape(words_to_fp16(v8, USE_ASM), [n, HEAD_DIM])
            vs_ptrs = v_scale_ptr + tok_slot * s_vs_slot + head * s_vs_head + tok_in_blk
            v_mul = tl.where(warm_ok, tl.load(vs_ptrs, mask=warm_ok, other=0.0), tok_ok.to(tl.float32)) * V_BOOST
        k8 = load_warm_k(
            warm_ptr, k_scale_ptr, slot_row, pos_row, is_int8_row, s_ent, s_i8_blk, j0, idx_hi, n_tok, head,
            s_warm_slot, s_warm_head, s_warm_tok, s_ks_slot, s_ks_head,
            HEAD_DIM, BLOCK_TOKENS, BLOCKS_PER_ITER, HAS_HOT, PARTITIONED, USE_ASM, WARM_FORMAT, K_GROUP,
        )
        if HAS_HOT:
            k += k8  # each element comes from one pool; the other load gave 0
            v += v8
        else:
            k = k8
            v = v8
    return k, v, v_mul
