"""The INT4 main loop of moe_gemm's grouped GEMM and the decode pair MMA: codes dequantized in registers
straight into the dot.

Layouts (moe_gemm "int4"): qweight int32 [E, N/16, K/128, 16, 16], tiled: in chunk c of row tile
r // 16, word i of row r holds, in nibble j, the code of W[r, 128c + 32 (j % 4) + 2i + j // 4] (the
paired order of fused_moe_int4, 16 rows a tile); scales [E, K/G, N] in the activation dtype; zeros
uint8 [E, K/G, N] (same strides); a [rows, K] with unit column stride; K % 128 == 0; G is 32, 64 or 128.

Nibbles j and j + 4 of a word are neighbouring channels 2i and 2i + 1 of slice j (32 channels). One
lop3 takes both into the halves of a register as OFFSET + q (w4a16_mma._pair), one packed subtraction
takes their group's zero point, and that register is already the pair of K-neighbours an MMA operand
register holds: the [BN, 32] operand of slice j is join(low halves, high halves), with no byte
permutes (the k-sliced order of the dense kernels, where the two halves are 64 channels apart, costs
a PRMT per half). The dot accumulates sum_k (q - z) a in fp32 per group (a K = 32 step per slice, on
a^T [32, BM] = a[:, 32j : 32j + 32]^T); the scale multiplies that once per group and output row. The
accumulators are transposed, acc [BN, BM] = W a^T, so the weight is the dot's register operand.
Zeros and scales run one chunk ahead: they are plain loads, and their latency hides behind a chunk's
work.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dsquant.runtime.kernels.gemm.w4a16_mma import _pair, _scale, _zero_pair


@triton.jit
def int4_words(w_ptr, expert, rows, n_mask, c, stride_we, stride_wc):
    """Packed words [BN, 16] of weight rows `rows`, 128-channel chunk c (contiguous 1 KiB per 16 rows
    in the tiled layout)."""
    row_off = tl.multiple_of((rows // 16) * stride_wc + (rows % 16) * 16, 16)  # [BN] word offsets
    ptrs = w_ptr + expert * stride_we + c * 256 + row_off[:, None] + tl.arange(0, 16)[None, :]
    return tl.load(ptrs, mask=n_mask[:, None], other=0)


@triton.jit
def _int4_tile(w_ptr, expert, rows, n_mask, k0, stride_we, stride_wc):
    """int4_words of the chunk holding channel k0 (k0 a multiple of 128)."""
    return int4_words(w_ptr, expert, rows, n_mask, k0 // 128, stride_we, stride_wc)


@triton.jit
def slice_params(z_ptr, s_ptr, c, stride_g, row_off, n_mask, GROUP: tl.constexpr, MAGIC: tl.constexpr):
    """Chunk c's zero pairs zz0..zz3 [BN] (OFFSET + z of slice j's group in both halves) and scales
    s0..s3 [BN, 1] of slices 0..3 (zeros at z_ptr + g * stride_g + row_off, scales likewise).
    G 128: one group; G 64: slices 0, 1 in group 2c, 2, 3 in 2c + 1; G 32: slice j in group 4c + j."""
    if GROUP == 128:
        zz0 = _zero_pair(z_ptr, c, c, stride_g, row_off, n_mask, MAGIC)
        s0 = _scale(s_ptr, c, stride_g, row_off, n_mask)
        zz1, zz2, zz3 = zz0, zz0, zz0
        s1, s2, s3 = s0, s0, s0
    elif GROUP == 64:
        zz0 = _zero_pair(z_ptr, 2 * c, 2 * c, stride_g, row_off, n_mask, MAGIC)
        zz2 = _zero_pair(z_ptr, 2 * c + 1, 2 * c + 1, stride_g, row_off, n_mask, MAGIC)
        s0 = _scale(s_ptr, 2 * c, stride_g, row_off, n_mask)
        s2 = _scale(s_ptr, 2 * c + 1, stride_g, row_off, n_mask)
        zz1, zz3 = zz0, zz2
        s1, s3 = s0, s2
    else:
        zz0 = _zero_pair(z_ptr, 4 * c, 4 * c, stride_g, row_off, n_mask, MAGIC)
        zz1 = _zero_pair(z_ptr, 4 * c + 1, 4 * c + 1, stride_g, row_off, n_mask, MAGIC)
        zz2 = _zero_pair(z_ptr, 4 * c + 2, 4 * c + 2, stride_g, row_off, n_mask, MAGIC)
        zz3 = _zero_pair(z_ptr, 4 * c + 3, 4 * c + 3, stride_g, row_off, n_mask, MAGIC)
        s0 = _scale(s_ptr, 4 * c, stride_g, row_off, n_mask)
        s1 = _scale(s_ptr, 4 * c + 1, stride_g, row_off, n_mask)
        s2 = _scale(s_ptr, 4 * c + 2, stride_g, row_off, n_mask)
        s3 = _scale(s_ptr, 4 * c + 3, stride_g, row_off, n_mask)
    return zz0, zz1, zz2, zz3, s0, s1, s2, s3


@triton.jit
def a_slice(a_ptr, a_row, row_mask, stride_am, k0):
    """a[a_row, k0 : k0 + 32]^T -> [32, BM] (masked rows zero)."""
    k_idx = k0 + tl.arange(0, 32)
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


@triton.jit
def int4_mainloop(a_ptr, a_row, row_mask, stride_am, w_ptr, s_ptr, z_ptr, expert, offs_n, n_mask, N, c_lo, c_hi,
                  stride_we, stride_wc, stride_se, stride_s1, stride_s2,
                  GATED: tl.constexpr, GROUP: tl.constexpr, MAGIC: tl.constexpr, PAIRED: tl.constexpr,
                  DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc_t, acc_up_t [BN, BM] (fp32, transposed: W a^T) over the 128-channel chunks [c_lo, c_hi) of
    expert `expert` (c_lo < c_hi); acc_up_t is the up projection's (rows N + offs_n) when GATED, else
    zeros."""
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    zs = z_ptr + expert * stride_se  # this expert's zeros and scales (same strides)
    ss = s_ptr + expert * stride_se
    rows = offs_n * stride_s2  # [BN]
    rows_up = (offs_n + N) * stride_s2
    z0, z1, z2, z3, s0, s1, s2, s3 = slice_params(zs, ss, c_lo, stride_s1, rows, n_mask, GROUP, MAGIC)
    y0, y1, y2, y3, u0, u1, u2, u3 = z0, z1, z2, z3, s0, s1, s2, s3
    if GATED:
        y0, y1, y2, y3, u0, u1, u2, u3 = slice_params(zs, ss, c_lo, stride_s1, rows_up, n_mask, GROUP, MAGIC)
    for c in range(c_lo, c_hi):
        k0 = c * 128
        packed = int4_words(w_ptr, expert, offs_n, n_mask, c, stride_we, stride_wc)  # [BN, 16]
        cn = tl.minimum(c + 1, c_hi - 1)
        nz0, nz1, nz2, nz3, t0, t1, t2, t3 = slice_params(zs, ss, cn, stride_s1, rows, n_mask, GROUP, MAGIC)
        a0 = a_slice(a_ptr, a_row, row_mask, stride_am, k0)  # [32, BM] each
        a1 = a_slice(a_ptr, a_row, row_mask, stride_am, k0 + 32)
        a2 = a_slice(a_ptr, a_row, row_mask, stride_am, k0 + 64)
        a3 = a_slice(a_ptr, a_row, row_mask, stride_am, k0 + 96)
        acc = chunk_dot_paired(acc, packed, z0, z1, z2, z3, s0, s1, s2, s3, a0, a1, a2, a3, GROUP, MAGIC, PAIRED,
                               DTYPE, BLOCK_N)
        z0, z1, z2, z3, s0, s1, s2, s3 = nz0, nz1, nz2, nz3, t0, t1, t2, t3
        if GATED:
            packed_up = int4_words(w_ptr, expert, offs_n + N, n_mask, c, stride_we, stride_wc)
            my0, my1, my2, my3, v0, v1, v2, v3 = slice_params(zs, ss, cn, stride_s1, rows_up, n_mask, GROUP, MAGIC)
            acc_up = chunk_dot_paired(acc_up, packed_up, y0, y1, y2, y3, u0, u1, u2, u3, a0, a1, a2, a3, GROUP,
                                      MAGIC, PAIRED, DTYPE, BLOCK_N)
            y0, y1, y2, y3, u0, u1, u2, u3 = my0, my1, my2, my3, v0, v1, v2, v3
    return acc, acc_up
