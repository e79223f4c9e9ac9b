"""The INT4 main loop of moe_gemm's grouped GEMM and the decode pair MMA: codes dequantized in registers
straight into the dot.

Layouts (moe_gemm "int4"): qweight int32 [E, N/16, K/128, 16, 16], tiled: in chunk c of row tile
r // 16, word i of row r holds, in nibble j, the code of W[r, 128c + 32 (j % 4) + 2i + j // 4] (the
paired order of int4_paired.py, 16 rows a tile); scales [E, K/G, N] in the activation dtype; zeros
uint8 [E, K/G, N] (same strides); a [rows, K] with unit column stride; K % 128 == 0; G is 32, 64 or 128;
act-order experts: perm int32 [E, K], the activation slices gathered through it (a[:, perm[e, k]]).

Per chunk, int4_paired.chunk_dot_paired: one lop3 and one packed subtraction give a register of two
K-neighbours, the slice's [BN, 32] operand is their join, one K = 32 dot per slice on a contiguous
activation slice. The accumulators are transposed, acc [BN, BM] = W a^T, so the weight is the dot's
register operand. Zeros and scales run one chunk ahead: they are plain loads, and their latency hides
behind a chunk's work.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dsquant.runtime.kernels.gemm.int4_paired import a_slice, chunk_dot_paired, slice_params


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
def int4_mainloop(a_ptr, a_row, row_mask, stride_am, w_ptr, s_ptr, z_ptr, expert, offs_n, n_mask, N, c_lo, c_hi,
                  stride_we, stride_wc, stride_se, stride_s1, stride_s2, perm_ptr, stride_pe,
                  GATED: tl.constexpr, GROUP: tl.constexpr, MAGIC: tl.constexpr, PAIRED: tl.constexpr,
                  DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_PERM: tl.constexpr = False):
    """acc_t, acc_up_t [BN, BM] (fp32, transposed: W a^T) over the 128-channel chunks [c_lo, c_hi) of
    expert `expert` (c_lo < c_hi); acc_up_t is the up projection's (rows N + offs_n) when GATED, else
    zeros. HAS_PERM (act-order): packed channel k meets a[:, perm[expert, k]] (perm int32 [E, K], row
    stride stride_pe)."""
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    zs = z_ptr + expert * stride_se  # this expert's zeros and scales (same strides)
    ss = s_ptr + expert * stride_se
    rows = offs_n * stride_s2  # [BN]
    pe = perm_ptr + expert * stride_pe  # this expert's channel order (read only under HAS_PERM)
    rows_up = (offs_n + N) * stride_s2
    z0, z1, z2, z3, s0, s1, s2, s3 = slice_params(zs, ss, c_lo, stride_s1, stride_s1, rows, n_mask, GROUP,
                                                  MAGIC)
    y0, y1, y2, y3, u0, u1, u2, u3 = z0, z1, z2, z3, s0, s1, s2, s3
    if GATED:
        y0, y1, y2, y3, u0, u1, u2, u3 = slice_params(zs, ss, c_lo, stride_s1, stride_s1, rows_up, n_mask,
                                                      GROUP, MAGIC)
    for c in range(c_lo, c_hi):
        k0 = c * 128
        packed = int4_words(w_ptr, expert, offs_n, n_mask, c, stride_we, stride_wc)  # [BN, 16]
        cn = tl.minimum(c + 1, c_hi - 1)
        nz0, nz1, nz2, nz3, t0, t1, t2, t3 = slice_params(zs, ss, cn, stride_s1, stride_s1, rows, n_mask, GROUP,
                                                          MAGIC)
        a0 = a_slice(a_ptr, pe, a_row, row_mask, stride_am, k0, HAS_PERM)  # [32, BM] each
        a1 = a_slice(a_ptr, pe, a_row, row_mask, stride_am, k0 + 32, HAS_PERM)
        a2 = a_slice(a_ptr, pe, a_row, row_mask, stride_am, k0 + 64, HAS_PERM)
        a3 = a_slice(a_ptr, pe, a_row, row_mask, stride_am, k0 + 96, HAS_PERM)
        acc = chunk_dot_paired(acc, packed, z0, z1, z2, z3, s0, s1, s2, s3, a0, a1, a2, a3, GROUP, MAGIC, PAIRED,
                               DTYPE, BLOCK_N)
        z0, z1, z2, z3, s0, s1, s2, s3 = nz0, nz1, nz2, nz3, t0, t1, t2, t3
        if GATED:
            packed_up = int4_words(w_ptr, expert, offs_n + N, n_mask, c, stride_we, stride_wc)
            my0, my1, my2, my3, v0, v1, v2, v3 = slice_params(zs, ss, cn, stride_s1, stride_s1, rows_up, n_mask,
                                                              GROUP, MAGIC)
            acc_up = chunk_dot_paired(acc_up, packed_up, y0, y1, y2, y3, u0, u1, u2, u3, a0, a1, a2, a3, GROUP,
                                      MAGIC, PAIRED, DTYPE, BLOCK_N)
            y0, y1, y2, y3, u0, u1, u2, u3 = my0, my1, my2, my3, v0, v1, v2, v3
    return acc, acc_up
