"""e4m3 cache tiles read as int32 words and converted to fp16 in registers, for the FP8-KV-cache decode kernels.

Why words: when a kernel writes `tl.dot(p, v.to(tl.float16))` over an e4m3 tile v, Triton hoists the
conversion into the shared-memory read that feeds the tensor-core operand. For the value tile of P @ V
the operand's K dimension is the token axis, which is strided in the cache, and with 8-bit elements
there is no transposing ldmatrix: that read became one LDS.U8 per byte plus a move to pack each pair
(sm_90 SASS of the GQA decode kernel, 128-token tiles: 128 LDS.U8 and 155 IMAD.MOV of 1104
instructions in the loop). Loading the same bytes as int32 words [BLOCK_N, COLS / 4] and building the
fp16 tile with join + reshape stops the hoisting: the words stream through shared memory in 16-byte
reads, one cvt.rn.f16x2.e4m3x2 converts two codes, and the fp16 tile reaches the operand through one
16-byte store and ldmatrix (the same loop: 692 instructions, no byte loads).

e4m3 -> fp16 is exact (3 mantissa bits, exponents 2^-9 .. 2^8 all fit fp16), so the dots can run in fp16
with no loss from the cache side. The other operand (the query, the probabilities times the value
scales) is brought into fp16's range by a power of two (`pow2_normalizer`), which is exact.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl


def words_fit(*caches) -> bool:
    """Whether e4m3 cache tensors (or views) can be read as int32 words: 4-byte-aligned bases, every stride but
    the last and the last dim multiples of 4 (so each token's row starts on a word)."""
    return all(t.data_ptr() % 4 == 0 and t.shape[-1] % 4 == 0 and all(st % 4 == 0 for st in t.stride()[:-1])
               for t in caches)


def words_asm_default() -> bool:
    """Inline PTX for the conversion: on a GPU, not under TRITON_INTERPRET (which runs no PTX)."""
    return os.environ.get("TRITON_INTERPRET", "0") != "1"


@triton.jit
def _byte_f16(w, SHIFT: tl.constexpr):
    """Byte SHIFT / 8 of each int32 word, an e4m3 code, as fp16 (the interpreter's path)."""
    return ((w >> SHIFT) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def e4m3_tile_f16(base_ptr, row, nmask, cols_valid, BLOCK_N: tl.constexpr, COLS: tl.constexpr, ASM: tl.constexpr):
    """The e4m3 tile [BLOCK_N, COLS] at base_ptr + row[:, None] + c (c < COLS) as fp16, read as words.

    base_ptr: an e4m3 (or uint8) pointer; row [BLOCK_N] int64 byte offsets of each token's first code,
    multiples of 4, and base_ptr 4-byte aligned; nmask [BLOCK_N]: tokens to read (others give 0);
    cols_valid: the codes per token that exist (a multiple of 4, <= COLS; the rest give 0).
    Element c of a token is byte c % 4 of word c // 4 (little-endian), so the tile keeps the cache's
    column order."""
    w_ptr = base_ptr.to(tl.pointer_type(tl.int32))
    c4 = tl.arange(0, COLS // 4)
    w = tl.load(w_ptr + (row // 4)[:, None] + c4[None, :], mask=nmask[:, None] & (c4 < cols_valid // 4)[None, :],
                other=0)  # [BLOCK_N, COLS / 4] int32
    if ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
            "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        b0, b1, b2, b3 = _byte_f16(w, 0), _byte_f16(w, 8), _byte_f16(w, 16), _byte_f16(w, 24)
    # join(join(b0, b2), join(b1, b3))[..., i, j] is byte 2i + j: flattened, the words' byte order
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [BLOCK_N, COLS])


@triton.jit
def pow2_normalizer(amax, TARGET_EXP: tl.constexpr):
    """2^(TARGET_EXP - floor(log2 amax)) for fp32 amax >= 0, an exact power of two (2^127 for amax 0), so that
    x * it has its largest magnitude in [2^TARGET_EXP, 2^(TARGET_EXP + 1)): exact, and inside fp16's range."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent
    return (tl.minimum(tl.maximum(127 + TARGET_EXP + 127 - e, 1), 254) << 23).to(tl.float32, bitcast=True)
