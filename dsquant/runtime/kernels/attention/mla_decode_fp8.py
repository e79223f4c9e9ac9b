"""Absorbed MLA decode over the FP8 latent cache, the scales folded into the dots (DeepSeek V2/V3).

Layouts: as mla_decode.py's FP8 cache. kv_cache uint8 [num_blocks, block_size, R + 4R/128 + 2P] in
FlashMLA's token layout (kv_fp8_layout.py), read through three views: latent e4m3 [.., .., R],
scales fp32 [.., .., G] (one per 128 latent values, G = R / 128 in 1, 2, 4), rope key
[.., .., P] in q_pe's 16-bit dtype. q_nope [B, H, R] (absorbed), q_pe [B, H, P], block_table
[B, max_blocks] int32, seq_lens [B] int32; out [B, H, R] or split partials [B, H, S, R] / [B, H, S].

Where mla_decode.py's kernel dequantizes each [BLOCK_N, R] latent tile (an fp32 multiply by
scales broadcast to every column, then a rounding), this one keeps the e4m3 codes as they are
(converted to q's dtype, exactly) and applies the scale of token t's group g where it is one number
per (t, g):
    score[h, t] = q_pe[h] . k_pe[t] + sum_g scale[t, g] * (q_nope[h, g] . code[t, g])
    out[h, g]   = sum_t (p[h, t] * scale[t, g]) . code[t, g]
so each group is its own pair of tensor-core dots over a [BLOCK_N, 128] tile, with G accumulators
[BLOCK_H, 128] in place of one [BLOCK_H, R]. Scores are exact in the scales (fp32 after the dot);
the value side rounds p * scale to q's dtype once, as the dequantizing kernel rounds the latent.
F16_DOTS (an experiment, off by default) runs both dots in fp16 whatever q's dtype: e4m3 converts to
fp16 in one instruction per pair, to bf16 through fp16 and fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dsquant.runtime.kernels.attention.split_kv_merge import split_bounds

MAX_GROUPS = 4  # R <= 512; larger ranks run mla_decode.py's dequantizing path


@triton.jit
def _group_scores(s, q, lat_ptr, row, c, sc_ptr, s_row, nmask, G: tl.constexpr, GROUP: tl.constexpr):
    """s + scale[:, G] * (q_nope[:, group G] . codes[:, group G]); returns (s, codes in q's dtype, scale)."""
    code = tl.load(lat_ptr + row[:, None] + G * GROUP + c[None, :], mask=nmask[:, None], other=0.0).to(q.dtype)
    sc = tl.load(sc_ptr + s_row + G, mask=nmask, other=0.0)  # [BLOCK_N] fp32
    return s + tl.dot(q, tl.trans(code)) * sc[None, :], code, sc


@triton.jit
def mla_decode_fp8_kernel(
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
    GROUPS: tl.constexpr, GROUP: tl.constexpr, F16_DOTS: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start, end = split_bounds(seq_len, split, num_splits, BLOCK_N, LONG_MIN, 4)

    c = tl.arange(0, GROUP)
    p = tl.arange(0, ROPE)
    hmask = heads < num_heads
    qmask = hmask[:, None] & (end > start)  # an empty split reads nothing
    q_row = qn_ptr + b * stride_qnb + heads[:, None] * stride_qnh + c[None, :]
    dot_ty = tl.float16 if F16_DOTS else qn_ptr.dtype.element_ty  # the codes and q_nope in the dots
    q0 = tl.load(q_row, mask=qmask, other=0.0).to(dot_ty)  # [BLOCK_H, 128], one per group
    q1, q2, q3 = q0, q0, q0
    if GROUPS > 1:
        q1 = tl.load(q_row + GROUP, mask=qmask, other=0.0).to(dot_ty)
    if GROUPS > 2:
        q2 = tl.load(q_row + 2 * GROUP, mask=qmask, other=0.0).to(dot_ty)
        q3 = tl.load(q_row + 3 * GROUP, mask=qmask, other=0.0).to(dot_ty)
    q_pe = tl.load(qp_ptr + b * stride_qpb + heads[:, None] * stride_qph + p[None, :],
                   mask=qmask, other=0.0)  # [BLOCK_H, P]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
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
        s_row = blk * stride_sblk + tok * stride_stok
        k_pe = tl.load(pe_ptr + blk[:, None] * stride_pblk + tok[:, None] * stride_ptok + p[None, :],
                       mask=nmask[:, None], other=0.0).to(q_pe.dtype)  # [BLOCK_N, P]
        s = tl.dot(q_pe, tl.trans(k_pe))  # [BLOCK_H, BLOCK_N] fp32
        s, code0, sc0 = _group_scores(s, q0, lat_ptr, row, c, sc_ptr, s_row, nmask, 0, GROUP)
        if GROUPS > 1:
            s, code1, sc1 = _group_scores(s, q1, lat_ptr, row, c, sc_ptr, s_row, nmask, 1, GROUP)
        if GROUPS > 2:
            s, code2, sc2 = _group_scores(s, q2, lat_ptr, row, c, sc_ptr, s_row, nmask, 2, GROUP)
            s, code3, sc3 = _group_scores(s, q3, lat_ptr, row, c, sc_ptr, s_row, nmask, 3, GROUP)
        s = tl.where(nmask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(prob, 1)
        acc0 = acc0 * alpha[:, None] + tl.dot((prob * sc0[None, :]).to(code0.dtype), code0)
        if GROUPS > 1:
            acc1 = acc1 * alpha[:, None] + tl.dot((prob * sc1[None, :]).to(code1.dtype), code1)
        if GROUPS > 2:
            acc2 = acc2 * alpha[:, None] + tl.dot((prob * sc2[None, :]).to(code2.dtype), code2)
            acc3 = acc3 * alpha[:, None] + tl.dot((prob * sc3[None, :]).to(code3.dtype), code3)
        m_i = m_new

    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if not IS_SPLIT:
        dst = out_ptr + b * stride_ob + heads[:, None] * stride_oh + c[None, :]
        store_groups(dst, acc0, acc1, acc2, acc3, inv, hmask[:, None], out_ptr.dtype.element_ty, GROUPS, GROUP)
    else:
        row_id = (b * num_heads + heads) * num_splits + split  # [BLOCK_H]
        dst = part_out_ptr + row_id[:, None] * RANK + c[None, :]
        store_groups(dst, acc0, acc1, acc2, acc3, inv, hmask[:, None] & (end > start), tl.float32, GROUPS, GROUP)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + row_id, lse, mask=hmask)


@triton.jit
def store_groups(dst, acc0, acc1, acc2, acc3, inv, mask, ty: tl.constexpr, GROUPS: tl.constexpr,
                  GROUP: tl.constexpr):
    tl.store(dst, (acc0 * inv).to(ty), mask=mask)
    if GROUPS > 1:
        tl.store(dst + GROUP, (acc1 * inv).to(ty), mask=mask)
    if GROUPS > 2:
        tl.store(dst + 2 * GROUP, (acc2 * inv).to(ty), mask=mask)
        tl.store(dst + 3 * GROUP, (acc3 * inv).to(ty), mask=mask)
