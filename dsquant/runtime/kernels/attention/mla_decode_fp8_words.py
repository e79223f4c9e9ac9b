"""Absorbed MLA decode over the FP8 latent cache: codes read as int32 words, scales folded, fp16 dots.

Layouts: as mla_decode.py's FP8 cache (the same arguments as its kernel, so `_launch` passes either):
kv_cache uint8 [num_blocks, block_size, R + 4R/128 + 2P] in FlashMLA's token layout, read through three
views: latent e4m3 [.., .., R] (R = 128 G, G in 1, 2, 4), scales fp32 [.., .., G] (one per 128 latent
values), rope key [.., .., P] in q_pe's 16-bit dtype. q_nope [B, H, R] (absorbed), q_pe [B, H, P],
block_table [B, max_blocks] int32, seq_lens [B] int32; out [B, H, R] or split partials [B, H, S, R] / [B, H, S].
Token rows must be 4-byte aligned (the 656-byte token of R 512, P 64 is).

The arithmetic is mla_decode_fp8.py's (each token's group scale on its score column and on the
probabilities, G pairs of dots over [BLOCK_N, 128] code tiles, G accumulators [BLOCK_H, 128]):
    score[h, t] = q_pe[h] . k_pe[t] + sum_g scale[t, g] * (q_nope[h, g] . code[t, g])
    out[h, g]   = sum_t (p[h, t] * scale[t, g]) . code[t, g]
with the reads and the precision of paged_decode_fp8.py:
- each code tile comes through `fp8_words.e4m3_tile_f16` (exact fp16, 16-byte shared-memory reads; the
  byte-wise reads Triton emits for `code.to(...)` feeding the P @ V operand are what it avoids);
- q_nope is scaled per head by a power of two into [256, 512) and rounded to fp16 (exact for bf16), the
  rope dot stays in q_pe's dtype;
- p * scale goes to fp16 times a per-head power of two from its running maximum (the largest in [1, 2)),
  divided out at the end, so tiny scales on dominant tokens keep their bits.
LAZY (MLADecodeConfig.lazy_rescale; FlashAttention-4's conditional rescale): the reference maximum m_i moves,
and the G accumulators are rescaled, only in tiles where some head's maximum grew by more than LAZY_TAU (log2
units; p then reaches at most 2^8) or its largest product would pass 2^14. The same in the bf16 MLA kernel and
the TMA prefill ran 0.83-0.99x as fast on an H100 and was removed (BENCHMARKS.md, thirty-first session).
"""
from __future__ import annotations

import triton
import triton.language as tl

from dsquant.runtime.kernels.attention.fp8_words import e4m3_tile_f16, pow2_normalizer
from dsquant.runtime.kernels.attention.mla_decode_fp8 import store_groups
from dsquant.runtime.kernels.attention.split_kv_merge import split_bounds

LAZY_TAU = tl.constexpr(8.0)



@triton.jit
def _codes(lat_ptr, row, nmask, G: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """Group G's codes of the tile, fp16 [BLOCK_N, GROUP]."""
    return e4m3_tile_f16(lat_ptr + G * GROUP, row, nmask, GROUP, BLOCK_N, GROUP, ASM)


@triton.jit
def _scales(sc_ptr, row, nmask, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's scales, one 4 x GROUPS-byte load a token, as GROUPS fp32 [BLOCK_N] (unused ones repeat)."""
    sc = tl.load(sc_ptr + (row // 4)[:, None] + tl.arange(0, GROUPS)[None, :], mask=nmask[:, None],
                 other=0.0)  # [BLOCK_N, GROUPS]
    if GROUPS == 1:
        s0 = tl.reshape(sc, [BLOCK_N])
        return s0, s0, s0, s0
    elif GROUPS == 2:
        s0, s1 = tl.split(sc)
        return s0, s1, s0, s1
    else:
        even, odd = tl.split(tl.reshape(sc, [BLOCK_N, 2, 2]))  # [BLOCK_N, 2]: groups (0, 2) and (1, 3)
        s0, s2 = tl.split(even)
        s1, s3 = tl.split(odd)
        return s0, s1, s2, s3


@triton.jit
def _rescale(acc0, acc1, acc2, acc3, ratio, GROUPS: tl.constexpr):
    r = ratio[:, None]
    acc0 = acc0 * r
    if GROUPS > 1:
        acc1 = acc1 * r
    if GROUPS > 2:
        acc2 = acc2 * r
        acc3 = acc3 * r
    return acc0, acc1, acc2, acc3


@triton.jit
def mla_decode_fp8_words_kernel(
    qn_ptr, stride_qnb, stride_qnh,  # q_nope [B, H, R]
    qp_ptr, stride_qpb, stride_qph,  # q_pe [B, H, P]
    lat_ptr, stride_lblk, stride_ltok,  # latent e4m3 [num_blocks, block_size, R]
    pe_ptr, stride_pblk, stride_ptok,  # rope key [num_blocks, block_size, P]
    sc_ptr, stride_sblk, stride_stok,  # scales fp32 [num_blocks, block_size, G]
    block_table_ptr, stride_bt, seq_lens_ptr,  # [B, max_blocks] int32, [B] int32
    out_ptr, stride_ob, stride_oh,  # out [B, H, R] (not IS_SPLIT)
    part_out_ptr, part_lse_ptr,  # [B, H, S, R], [B, H, S] float32 (IS_SPLIT)
    scale_log2, num_splits, num_heads,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_SPLIT: tl.constexpr, LONG_MIN: tl.constexpr,
    GROUPS: tl.constexpr, GROUP: tl.constexpr, MIN_TILES: tl.constexpr, ASM: tl.constexpr,
    LAZY: tl.constexpr = False,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start, end = split_bounds(seq_len, split, num_splits, BLOCK_N, LONG_MIN, MIN_TILES)

    c = tl.arange(0, GROUP)
    p = tl.arange(0, ROPE)
    hmask = heads < num_heads
    qmask = hmask[:, None] & (end > start)  # an empty split reads nothing
    q_row = qn_ptr + b * stride_qnb + heads[:, None] * stride_qnh + c[None, :]
    q0 = tl.load(q_row, mask=qmask, other=0.0).to(tl.float32)  # [BLOCK_H, 128], one per group
    q1, q2, q3 = q0, q0, q0
    amax = tl.max(tl.abs(q0), 1)  # [BLOCK_H]
    if GROUPS > 1:
        q1 = tl.load(q_row + GROUP, mask=qmask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(q1), 1))
    if GROUPS > 2:
        q2 = tl.load(q_row + 2 * GROUP, mask=qmask, other=0.0).to(tl.float32)
        q3 = tl.load(q_row + 3 * GROUP, mask=qmask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.maximum(tl.max(tl.abs(q2), 1), tl.max(tl.abs(q3), 1)))
    q_mul = pow2_normalizer(amax, 8)  # [BLOCK_H]
    q0 = (q0 * q_mul[:, None]).to(tl.float16)
    q1 = (q1 * q_mul[:, None]).to(tl.float16)
    q2 = (q2 * q_mul[:, None]).to(tl.float16)
    q3 = (q3 * q_mul[:, None]).to(tl.float16)
    q_inv = 1.0 / q_mul  # [BLOCK_H], exact
    q_pe = tl.load(qp_ptr + b * stride_qpb + heads[:, None] * stride_qph + p[None, :],
                   mask=qmask, other=0.0)  # [BLOCK_H, P]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    pv_max = tl.zeros([BLOCK_H], tl.float32)  # max_t p_t * max_g scale[t, g] (p relative to the current m_i)
    pv_mul = tl.full([BLOCK_H], 1.0, tl.float32)  # a power of two: 1 / pv_max, rounded down to one
    acc0 = tl.zeros([BLOCK_H, GROUP], tl.float32)
    acc1 = tl.zeros([BLOCK_H, GROUP], tl.float32)
    acc2 = tl.zeros([BLOCK_H, GROUP], tl.float32)
    acc3 = tl.zeros([BLOCK_H, GROUP], tl.float32)
    table = block_table_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        blk = tl.load(table + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        tok = n % BLOCK_SIZE
        row = blk * stride_lblk + tok * stride_ltok  # [BLOCK_N]
        # the scales and the rope key share the latent's token rows (row in bytes, a multiple of 16 for the 656-byte
        # token), so their offsets come from row: 16-byte loads that Triton pipelines, where their own views'
        # element strides (164 and 328 a token) would give 4- and 2-byte ones
        k_pe = tl.load(pe_ptr + (row // 2)[:, None] + p[None, :],
                       mask=nmask[:, None], other=0.0).to(q_pe.dtype)  # [BLOCK_N, P]
        sc0, sc1, sc2, sc3 = _scales(sc_ptr, row, nmask, GROUPS, BLOCK_N)  # [BLOCK_N] each
        code0 = _codes(lat_ptr, row, nmask, 0, GROUP, BLOCK_N, ASM)
        s_nope = tl.dot(q0, tl.trans(code0)) * sc0[None, :]  # [BLOCK_H, BLOCK_N]
        sc_max = sc0
        if GROUPS > 1:
            code1 = _codes(lat_ptr, row, nmask, 1, GROUP, BLOCK_N, ASM)
            s_nope = s_nope + tl.dot(q1, tl.trans(code1)) * sc1[None, :]
            sc_max = tl.maximum(sc_max, sc1)
        if GROUPS > 2:
            code2 = _codes(lat_ptr, row, nmask, 2, GROUP, BLOCK_N, ASM)
            code3 = _codes(lat_ptr, row, nmask, 3, GROUP, BLOCK_N, ASM)
            s_nope = s_nope + tl.dot(q2, tl.trans(code2)) * sc2[None, :] + tl.dot(q3, tl.trans(code3)) * sc3[None, :]
            sc_max = tl.maximum(sc_max, tl.maximum(sc2, sc3))
        s = tl.dot(q_pe, tl.trans(k_pe)) + s_nope * q_inv[:, None]  # [BLOCK_H, BLOCK_N] fp32
        s = tl.where(nmask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if LAZY:  # move m_i only when a head's maximum grew by > LAZY_TAU: p <= 2^8
            grow = tl.max(tl.where(m_new > m_i, m_new - m_i, 0.0), 0) > LAZY_TAU
            m_new = tl.where(grow, m_new, m_i)
        alpha = tl.exp2(m_i - m_new)  # 1 where m_i stayed; 0 on the first tile (m_i -inf)
        prob = tl.exp2(s - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(prob, 1)
        pv_max = tl.maximum(pv_max * alpha, tl.max(prob * sc_max[None, :], 1))
        pv_mul_new = pow2_normalizer(pv_max, 0)  # [BLOCK_H]
        if LAZY:  # keep the power while m_i stays and the largest product stays under 2^14 (fp16 holds 65504)
            pv_mul_new = tl.where(grow | (tl.max(pv_max * pv_mul, 0) >= 16384.0), pv_mul_new, pv_mul)
        ratio = alpha * (pv_mul_new / pv_mul)  # [BLOCK_H]: 1 for every head when nothing moved
        if LAZY:
            if tl.max(tl.abs(ratio - 1.0), 0) > 0.0:  # the [BLOCK_H, R] rescale only in tiles that need it
                acc0, acc1, acc2, acc3 = _rescale(acc0, acc1, acc2, acc3, ratio, GROUPS)
        else:
            acc0, acc1, acc2, acc3 = _rescale(acc0, acc1, acc2, acc3, ratio, GROUPS)
        prob = prob * pv_mul_new[:, None]
        acc0 = tl.dot((prob * sc0[None, :]).to(tl.float16), code0, acc0)
        if GROUPS > 1:
            acc1 = tl.dot((prob * sc1[None, :]).to(tl.float16), code1, acc1)
        if GROUPS > 2:
            acc2 = tl.dot((prob * sc2[None, :]).to(tl.float16), code2, acc2)
            acc3 = tl.dot((prob * sc3[None, :]).to(tl.float16), code3, acc3)
        m_i = m_new
        pv_mul = pv_mul_new

    inv = 1.0 / (tl.where(l_i > 0, l_i, 1.0) * pv_mul)[:, None]  # pv_mul <= 2^36: the scale floor
    if not IS_SPLIT:
        dst = out_ptr + b * stride_ob + heads[:, None] * stride_oh + c[None, :]
        store_groups(dst, acc0, acc1, acc2, acc3, inv, hmask[:, None], out_ptr.dtype.element_ty, GROUPS, GROUP)
    else:
        row_id = (b * num_heads + heads) * num_splits + split  # [BLOCK_H]
        dst = part_out_ptr + row_id[:, None] * RANK + c[None, :]
        store_groups(dst, acc0, acc1, acc2, acc3, inv, hmask[:, None] & (end > start), tl.float32, GROUPS, GROUP)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + row_id, lse, mask=hmask)

