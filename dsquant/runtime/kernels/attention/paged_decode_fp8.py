"""Paged GQA / MHA decode over the FP8 cache, its tiles read as words and both dots in fp16.

Layouts: paged_decode.py's FP8 path, the same launch (grid (B, Hkv, splits), the same split partials):
query [B, Hq, D] (bf16 or fp16); k_cache, v_cache float8_e4m3fn [num_blocks, block_size, Hkv, D] with
D a multiple of 4 and 4-byte-aligned rows; k_scale, v_scale float32 [num_blocks, block_size, Hkv];
block_table [B, max_blocks] int32, seq_lens [B] int32; out [B, Hq, D] or partials [B, Hq, S, D] / [B, Hq, S].

What differs from paged_decode.py's kernel (fp8_words.py says why the words):
- K and V tiles come through `e4m3_tile_f16`: exact fp16 codes, no byte-wise shared-memory reads.
- The query is scaled per head by a power of two into [256, 512) and rounded to fp16, which is exact for
  a bf16 query (fp16 holds more mantissa; only components below 2^-14 of the head's largest lose bits);
  the score columns take the key scales and the heads' inverse powers back in fp32.
- The probabilities times the value scales feed the P @ V dot in fp16. Value scales span orders of
  magnitude (from 1e-8 / 448 up) and the token that dominates a head's output may have a tiny one, so each
  head's products are multiplied by a power of two chosen from their running maximum (carried through the
  softmax's rescaling like the accumulator itself): the largest lands in [1, 2), and any product that
  matters to the output stays in fp16's normal range. When that power changes, the accumulator's rescale
  takes the exact ratio, and the end divides it out.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dsquant.runtime.kernels.attention.fp8_words import e4m3_tile_f16, pow2_normalizer
from dsquant.runtime.kernels.attention.split_kv_merge import split_bounds, store_split_result



@triton.jit
def paged_decode_fp8_words_kernel(
    q_ptr, stride_qb, stride_qh,  # query [B, Hq, D]
    k_ptr, v_ptr, stride_cblk, stride_ctok, stride_chead,  # caches e4m3 [num_blocks, block_size, Hkv, D]
    ks_ptr, vs_ptr, stride_sblk, stride_stok,  # scales [num_blocks, block_size, Hkv] fp32
    block_table_ptr, stride_bt, seq_lens_ptr,  # [B, max_blocks] int32, [B] int32
    out_ptr, stride_ob, stride_oh,  # out [B, Hq, D] (not IS_SPLIT)
    part_out_ptr, part_lse_ptr,  # [B, Hq, S, D], [B, Hq, S] float32 (IS_SPLIT)
    scale_log2, num_splits, num_q_heads,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_SPLIT: tl.constexpr, ASM: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start, end = split_bounds(seq_len, split, num_splits, BLOCK_N, 0, 4)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g  # [BLOCK_G]
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # [BLOCK_G, BLOCK_D]
    q_mul = pow2_normalizer(tl.max(tl.abs(q), 1), 8)  # [BLOCK_G]
    q16 = (q * q_mul[:, None]).to(tl.float16)
    row_scale = scale_log2 / q_mul  # [BLOCK_G]: exact powers of two times scale_log2

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)  # sum_t p_t * v_scale_t * pv_mul * codes_t, per head
    pv_max = tl.zeros([BLOCK_G], tl.float32)  # max_t p_t * v_scale_t (p relative to the current m_i)
    pv_mul = tl.full([BLOCK_G], 1.0, tl.float32)  # a power of two: 1 / pv_max, rounded down to one
    table = block_table_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        nmask = n < end
        blk = tl.load(table + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        row = blk * stride_cblk + (n % BLOCK_SIZE) * stride_ctok + kv_head * stride_chead  # [BLOCK_N]
        srow = blk * stride_sblk + (n % BLOCK_SIZE) * stride_stok + kv_head  # [BLOCK_N]
        k = e4m3_tile_f16(k_ptr, row, nmask, HEAD_DIM, BLOCK_N, BLOCK_D, ASM)  # [BLOCK_N, BLOCK_D] fp16
        k_sc = tl.load(ks_ptr + srow, mask=nmask, other=0.0)  # [BLOCK_N]
        s = tl.dot(q16, tl.trans(k)) * k_sc[None, :] * row_scale[:, None]  # [BLOCK_G, BLOCK_N], log2 units
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pvs = p * tl.load(vs_ptr + srow, mask=nmask, other=0.0)[None, :]  # [BLOCK_G, BLOCK_N]
        pv_max = tl.maximum(pv_max * alpha, tl.max(pvs, 1))
        pv_mul_new = pow2_normalizer(pv_max, 0)  # [BLOCK_G]
        v = e4m3_tile_f16(v_ptr, row, nmask, HEAD_DIM, BLOCK_N, BLOCK_D, ASM)  # [BLOCK_N, BLOCK_D] fp16
        pv = (pvs * pv_mul_new[:, None]).to(tl.float16)  # [BLOCK_G, BLOCK_N], each < 2
        acc = acc * (alpha * (pv_mul_new / pv_mul))[:, None] + tl.dot(pv, v)
        m_i = m_new
        pv_mul = pv_mul_new

    out = acc / pv_mul[:, None] / tl.where(l_i > 0, l_i, 1.0)[:, None]
    store_split_result(out, m_i, l_i, b, heads, gmask, d, dmask, end > start, split, num_q_heads, num_splits,
                       out_ptr + b * stride_ob, stride_oh, part_out_ptr, part_lse_ptr, HEAD_DIM, IS_SPLIT)
