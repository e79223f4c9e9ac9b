"""Absorbed MLA decode over the FP8 latent cache, the next tile's codes loaded one iteration ahead.

Layouts: exactly mla_decode.py's FP8 path (same arguments as its kernel, so _launch passes either):
kv_cache uint8 [num_blocks, block_size, R + 4R/128 + 2P] in FlashMLA's token layout, read through
three views: latent e4m3 [.., .., R], scales fp32 [.., .., G] (one per 128 latent values), rope key
[.., .., P] in q_pe's 16-bit dtype. q_nope [B, H, R] (absorbed), q_pe [B, H, P], block_table
[B, max_blocks] int32, seq_lens [B] int32; out [B, H, R] or split partials [B, H, S, R] / [B, H, S].

Why: with a bf16 cache the latent tile feeds the dots straight from its load, so Triton's pipeliner
streams the next tiles into shared memory while the current one is used (num_stages 2 ran 1.6x
faster than 1 on the H200). An e4m3 tile is dequantized in registers between its load and the
dots, which the pipeliner does not stream: the FP8 kernel ran at the same speed with 1 or 2 stages,
about 0.8 TB/s (BENCHMARKS.md, FP8 KV cache). Here the loop carries the next tile (its block-table
entries, codes, scales and rope key) in registers: its loads are issued before the current tile's
dequantize + dots + softmax, so their latency hides behind that work. The prologue loads the first
tile; past the split's end the prefetch is fully masked (no memory traffic). F16: the dots in fp16
(e4m3 -> fp16 is one instruction per pair), as mla_decode.py's F16.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dsquant.runtime.kernels.attention.split_kv_merge import split_bounds


@triton.jit
def _tile(table, lat_ptr, stride_lblk, stride_ltok, pe_ptr, stride_pblk, stride_ptok, sc_ptr, stride_sblk,
          stride_stok, n0, end, r, p, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """Tokens [n0, n0 + BLOCK_N) of a sequence (masked at end): (codes e4m3 [BN, R], rope key [BN, P],
    scales fp32 [BN, GROUPS], nmask [BN])."""
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < end
    blk = tl.load(table + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    tok = n % BLOCK_SIZE
    code = tl.load(lat_ptr + (blk * stride_lblk + tok * stride_ltok)[:, None] + r[None, :], mask=nmask[:, None],
                   other=0.0)  # [BN, R]
    k_pe = tl.load(pe_ptr + (blk * stride_pblk + tok * stride_ptok)[:, None] + p[None, :], mask=nmask[:, None],
                   other=0.0)  # [BN, P]
    sc = tl.load(sc_ptr + (blk * stride_sblk + tok * stride_stok)[:, None] + tl.arange(0, GROUPS)[None, :],
                 mask=nmask[:, None], other=0.0)  # [BN, GROUPS]
    return code, k_pe, sc, nmask


@triton.jit
def mla_decode_fp8_prefetch_kernel(
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
    KV_FP8: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr, F16: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start, end = split_bounds(seq_len, split, num_splits, BLOCK_N, LONG_MIN, 4)

    r = tl.arange(0, RANK)
    p = tl.arange(0, ROPE)
    hmask = heads < num_heads
    qmask = hmask[:, None] & (end > start)  # an empty split reads nothing
    dot_ty = tl.float16 if F16 else qn_ptr.dtype.element_ty
    q_nope = tl.load(qn_ptr + b * stride_qnb + heads[:, None] * stride_qnh + r[None, :],
                     mask=qmask, other=0.0).to(dot_ty)  # [BLOCK_H, R]
    q_pe = tl.load(qp_ptr + b * stride_qpb + heads[:, None] * stride_qph + p[None, :],
                   mask=qmask, other=0.0).to(dot_ty)  # [BLOCK_H, P]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK], tl.float32)
    table = block_table_ptr + b.to(tl.int64) * stride_bt
    code, k_pe, sc, nmask = _tile(table, lat_ptr, stride_lblk, stride_ltok, pe_ptr, stride_pblk, stride_ptok,
                                  sc_ptr, stride_sblk, stride_stok, start, end, r, p, BLOCK_SIZE, BLOCK_N, GROUPS)
    for n0 in range(start, end, BLOCK_N):
        nxt_code, nxt_pe, nxt_sc, nxt_mask = _tile(table, lat_ptr, stride_lblk, stride_ltok, pe_ptr, stride_pblk,
                                                   stride_ptok, sc_ptr, stride_sblk, stride_stok, n0 + BLOCK_N, end,
                                                   r, p, BLOCK_SIZE, BLOCK_N, GROUPS)
        if GROUPS == 1:
            scale = sc  # [BN, 1]
        else:
            scale = tl.reshape(tl.broadcast_to(sc[:, :, None], [BLOCK_N, GROUPS, GROUP]), [BLOCK_N, RANK])
        if F16:
            latent = code.to(tl.float16) * scale.to(tl.float16)  # [BN, R]
        else:
            latent = (code.to(tl.float32) * scale).to(dot_ty)  # [BN, R]
        s = tl.dot(q_nope, tl.trans(latent))
        s = tl.dot(q_pe, tl.trans(k_pe.to(dot_ty)), s) * scale_log2  # [BLOCK_H, BN]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(dot_ty), latent)
        m_i = m_new
        code, k_pe, sc, nmask = nxt_code, nxt_pe, nxt_sc, nxt_mask

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if not IS_SPLIT:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        row_id = (b * num_heads + heads) * num_splits + split  # [BLOCK_H]
        tl.store(part_out_ptr + row_id[:, None] * RANK + r[None, :], out, mask=hmask[:, None] & (end > start))
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + row_id, lse, mask=hmask)
