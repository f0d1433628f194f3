"""Packed warm-format words -> fp16 values in registers, exactly, for the paged decode tiles (tiles.py).

Each reads int32 words (the warm pool viewed as int32) and returns fp16 values in memory order, shaped
[..., W, 2, 2] (4 a word: int8, fp8 e4m3) or [..., W, 2, 2, 2] (8 a word: int4 codes). USE_ASM (a real CUDA
launch) decodes two values per 32-bit op with inline PTX; the plain-Triton twin is for the interpreter, which
cannot run PTX, and is checked against the torch reference on CPU.
  int8   fp16 with bits 0x64 | (x + 128) is 1152 + x: an xor, a byte permute and one subtraction (I2F runs
         at quarter rate on sm_90)
  fp8    e4m3 bits b as fp16 bits (b & 0x80) << 8 | (b & 0x7F) << 7 are the value / 256: a permute, a
         shift, two masks, then one packed multiply by 256
  int4   a code x as fp16 bits 0x6400 | x is 1024 + x: one mask-and-or (lop3) and one packed subtraction
         for two codes
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
        b0, b1, b2, b3 = _bytes_to_fp16(words, False)
    return _memory_order(b0, b1, b2, b3)


@triton.jit
def _fp8_byte_to_fp16(words, k: tl.constexpr):
    """Byte k of each int32 word, e4m3 bits, to fp16: fp16 bits (b & 0x80) << 8 | (b & 0x7F) << 7 are the
    value / 256 (e4m3's subnormals land in fp16's, exactly)."""
    b = (words >> (8 * k)) & 0xFF
    bits = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def _bytes_to_fp16(words, FP8: tl.constexpr):
    """The four bytes of each word as fp16, plain Triton (the interpreter's twin of the PTX): int8 or e4m3."""
    if FP8:
        return (_fp8_byte_to_fp16(words, 0), _fp8_byte_to_fp16(words, 1), _fp8_byte_to_fp16(words, 2),
                _fp8_byte_to_fp16(words, 3))
    return _byte_to_fp16(words, 0), _byte_to_fp16(words, 1), _byte_to_fp16(words, 2), _byte_to_fp16(words, 3)


@triton.jit
def _memory_order(b0, b1, b2, b3):
    """Bytes 0-3 of each word -> [..., W, 2, 2]: [..., w, i, j] = byte 2 i + j of word w."""
    return tl.join(tl.join(b0, b2), tl.join(b1, b3))


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
        b0, b1, b2, b3 = _bytes_to_fp16(words, True)
    return _memory_order(b0, b1, b2, b3)


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
