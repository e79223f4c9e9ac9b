"""INT4 codes in the paired order, the layout every INT4 kernel reads (dense W4A16 and MoE experts).

Within each 128-channel chunk of a weight row, 16 int32 words hold the chunk's 128 codes: nibble j (bits
4j..4j + 3) of word i holds the code of channel 32 (j % 4) + 2i + j // 4 (`paired_channel`). So nibbles j
and j + 4 of a word are neighbouring channels 2i and 2i + 1 of slice j % 4 (32 channels). One lop3,
(word >> 4j) & 0x000F000F | MAGIC2, takes both into the halves of a register as OFFSET + q exactly (a
code OR-ed into the mantissa of 128.0, bf16 0x4300; fp16 1024.0, 0x6400), and one packed subtraction
takes their group's zero point: that register is the pair of K-neighbours an MMA operand register
holds, so the [BN, 32] operand of a slice is join(low halves, high halves) with no byte permutes
(Marlin's idea; the earlier k-sliced order put the halves 64 channels apart and cost a PRMT each).
Groups: G 128 is the chunk; G 64 is slices 0, 1 and 2, 3; G 32 is one slice.

The dots here take the weight as the MMA's register operand (acc [BN, BM] = W a^T), one K = 32 step per
slice on a contiguous 32-channel activation slice [32, BM]; the scale multiplies sum_k (q - z) a once
per group and output row. The GEMVs read the same words plane by plane: plane j against the stride-2
activation slice a[32 (j % 4) + j // 4 :: 2].
"""
from __future__ import annotations

import triton
import triton.language as tl


def paired_channel(j: int, i: int) -> int:
    """The chunk channel whose code nibble j of word i holds."""
    return 32 * (j % 4) + 2 * i + j // 4


@triton.jit
def _pair(qw, zz, SHIFT: tl.constexpr, MAGIC: tl.constexpr, PAIRED: tl.constexpr, dtype: tl.constexpr):
    """words [BN, 16] -> (q - z) of nibbles j (low) and j + 4 (high) in `dtype` (exact small integers),
    j = SHIFT / 4.

    zz int32 [BN, 16]: the bit patterns of OFFSET + z for the low half's group and the high half's (MAGIC
    0: plain z, for fp32). PAIRED: one lop3 and one packed subtraction for two codes (inline PTX: on a GPU,
    not under TRITON_INTERPRET, where the same arithmetic runs unpacked)."""
    t = qw >> SHIFT
    if MAGIC == 0:  # fp32 activations (the MoE GEMM on CPU): q - z as integers, converted exactly
        return (((t & 0xF) - (zz & 0xFFFF)).to(dtype), (((t >> 16) & 0xF) - ((zz >> 16) & 0xFFFF)).to(dtype))
    if PAIRED:
        if MAGIC == 0x4300:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xEA; sub.rn.bf16x2 t, t, $3; "
                "mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r", [t, zz], dtype=(tl.int16, tl.int16), is_pure=True, pack=1)
        else:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x64006400, 0xEA; sub.rn.f16x2 t, t, $3; "
                "mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r", [t, zz], dtype=(tl.int16, tl.int16), is_pure=True, pack=1)
        return lo.to(dtype, bitcast=True), hi.to(dtype, bitcast=True)
    lo = ((t & 0xF) | MAGIC).to(tl.int16).to(dtype, bitcast=True)
    hi = (((t >> 16) & 0xF) | MAGIC).to(tl.int16).to(dtype, bitcast=True)
    z_lo = (zz & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
    z_hi = ((zz >> 16) & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
    return lo - z_lo, hi - z_hi


@triton.jit
def _zero_pair(z_ptr, g_lo, g_hi, stride_zg, row_off, n_mask, MAGIC: tl.constexpr):
    """int32 [BN]: OFFSET + z of group g_lo in the low half, of g_hi in the high half (row_off [BN]:
    the rows' element offsets)."""
    z_lo = tl.load(z_ptr + g_lo * stride_zg + row_off, mask=n_mask, other=0).to(tl.int32) | MAGIC
    z_hi = tl.load(z_ptr + g_hi * stride_zg + row_off, mask=n_mask, other=0).to(tl.int32) | MAGIC
    return z_lo | (z_hi << 16)


@triton.jit
def _scale(s_ptr, g, stride_sg, row_off, n_mask):
    return tl.load(s_ptr + g * stride_sg + row_off, mask=n_mask, other=0.0).to(tl.float32)[:, None]  # [BN, 1]


@triton.jit
def slice_params(z_ptr, s_ptr, c, stride_zg, stride_sg, row_off, n_mask, GROUP: tl.constexpr,
                 MAGIC: tl.constexpr):
    """Chunk c's zero pairs zz0..zz3 [BN] (OFFSET + z of slice j's group in both halves) and scales
    s0..s3 [BN, 1] of slices 0..3 (zeros at z_ptr + g * stride_zg + row_off, scales at s_ptr + g *
    stride_sg + row_off).
    G 128: one group; G 64: slices 0, 1 in group 2c, 2, 3 in 2c + 1; G 32: slice j in group 4c + j."""
    if GROUP == 128:
        zz0 = _zero_pair(z_ptr, c, c, stride_zg, row_off, n_mask, MAGIC)
        s0 = _scale(s_ptr, c, stride_sg, row_off, n_mask)
        zz1, zz2, zz3 = zz0, zz0, zz0
        s1, s2, s3 = s0, s0, s0
    elif GROUP == 64:
        zz0 = _zero_pair(z_ptr, 2 * c, 2 * c, stride_zg, row_off, n_mask, MAGIC)
        zz2 = _zero_pair(z_ptr, 2 * c + 1, 2 * c + 1, stride_zg, row_off, n_mask, MAGIC)
        s0 = _scale(s_ptr, 2 * c, stride_sg, row_off, n_mask)
        s2 = _scale(s_ptr, 2 * c + 1, stride_sg, row_off, n_mask)
        zz1, zz3 = zz0, zz2
        s1, s3 = s0, s2
    else:
        zz0 = _zero_pair(z_ptr, 4 * c, 4 * c, stride_zg, row_off, n_mask, MAGIC)
        zz1 = _zero_pair(z_ptr, 4 * c + 1, 4 * c + 1, stride_zg, row_off, n_mask, MAGIC)
        zz2 = _zero_pair(z_ptr, 4 * c + 2, 4 * c + 2, stride_zg, row_off, n_mask, MAGIC)
        zz3 = _zero_pair(z_ptr, 4 * c + 3, 4 * c + 3, stride_zg, row_off, n_mask, MAGIC)
        s0 = _scale(s_ptr, 4 * c, stride_sg, row_off, n_mask)
        s1 = _scale(s_ptr, 4 * c + 1, stride_sg, row_off, n_mask)
        s2 = _scale(s_ptr, 4 * c + 2, stride_sg, row_off, n_mask)
        s3 = _scale(s_ptr, 4 * c + 3, stride_sg, row_off, n_mask)
    return zz0, zz1, zz2, zz3, s0, s1, s2, s3


@triton.jit
def a_slice(a_ptr, perm_ptr, a_row, row_mask, stride_am, k0, HAS_PERM: tl.constexpr = False):
    """a[a_row, k0 : k0 + 32]^T -> [32, BM] (masked rows zero; channels through perm under act-order)."""
    k_idx = k0 + tl.arange(0, 32)
    if HAS_PERM:
        k_idx = tl.load(perm_ptr + k_idx)
    return tl.load(a_ptr + a_row[None, :] * stride_am + k_idx[:, None], mask=row_mask[None, :], other=0.0)


@triton.jit
def _slice_w(qw, zz, J: tl.constexpr, MAGIC: tl.constexpr, PAIRED: tl.constexpr, dtype: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """words [BN, 16] -> slice J's (q - z) [BN, 32] in `dtype`: column 2i + h is nibble J + 4h of word i."""
    lo, hi = _pair(qw, tl.broadcast_to(zz[:, None], (BLOCK_N, 16)), 4 * J, MAGIC, PAIRED, dtype)
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, 32))


@triton.jit
def chunk_dot_paired(acc, qw, zz0, zz1, zz2, zz3, s0, s1, s2, s3, a0, a1, a2, a3, GROUP: tl.constexpr,
                     MAGIC: tl.constexpr, PAIRED: tl.constexpr, dtype: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BN, BM] += one 128-channel chunk: words qw [BN, 16] (paired order) times the a^T slices
    a0..a3 [32, BM] of channels 32j..32j + 31; zz / s from slice_params."""
    d = tl.dot(_slice_w(qw, zz0, 0, MAGIC, PAIRED, dtype, BLOCK_N), a0)
    if GROUP == 32:
        acc += s0 * d
        d = tl.zeros_like(acc)
    d = tl.dot(_slice_w(qw, zz1, 1, MAGIC, PAIRED, dtype, BLOCK_N), a1, d)
    if GROUP <= 64:
        acc += s1 * d
        d = tl.zeros_like(acc)
    d = tl.dot(_slice_w(qw, zz2, 2, MAGIC, PAIRED, dtype, BLOCK_N), a2, d)
    if GROUP == 32:
        acc += s2 * d
        d = tl.zeros_like(acc)
    d = tl.dot(_slice_w(qw, zz3, 3, MAGIC, PAIRED, dtype, BLOCK_N), a3, d)
    return acc + s3 * d
