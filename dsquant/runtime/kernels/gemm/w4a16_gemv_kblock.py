"""W4A16 GEMV over the paired code order, K_CHUNKS 128-channel chunks a step: y = x @ dequant(W)^T
for decode batches of 1 or 2 tokens, no tensor cores.

Layouts (w4a16_repack.py's kernel layout, paired order): x [M, K] bf16/fp16 (unit column stride);
qweight int32 [N, K/8] in the paired order, word 16c + w of row n holding in nibble j the code of
k = 128c + 32 (j % 4) + 2w + j // 4 (int4_paired.py);
scales [K/G, N]; zeros uint8 [K/G, N]; perm int32 [K] or None (act-order: x[:, perm[j]] meets packed
channel j); y [M, N] in x's dtype. G is 32, 64 or 128; K % 128 == 0.

Why: at decode a small projection (2048 x 2048 is 2 MiB of codes) is over before a one-chunk-a-step
GEMV (w4a16_gemv.py) has many loads in flight, and its split-K reduction through global memory is a
large share of the time. Here each program loads a [BLOCK_N, K_CHUNKS, 16] block of words at once
(K_CHUNKS * 64 contiguous bytes per row), so a V2-Lite projection with K = 2048 is one step per
program and needs no split; larger K loops over blocks (split-K by splitk.store_tile where the
grid would not fill the GPU).

Per block, every element of the [BLOCK_N, K_CHUNKS, 16] tile stays in its thread: nibble plane j
becomes fp32 128 + q (w4a16_gemv.plane_f32: one shift, one lop3), d += (128 + q) x_j with x_j the
[K_CHUNKS, 16] stride-2 activation slice of plane j, and per quantization group
    acc3 += s * (d - (128 + z) * sum_{k in group} x)
elementwise, so the only cross-thread reduction is the final sum of acc3 over its last two axes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.gemm.w4a16_mma import paired_default
from dsquant.runtime.kernels.gemm.splitk import split_range, splitk_buffers, store_tile
from dsquant.runtime.kernels.gemm.w4a16_gemv import plane_f32


@triton.jit
def _group_terms(qw, high, x_ptr, perm_ptr, m, M, stride_xm, chunk, c_mask, offs_w, gi: tl.constexpr,
                 SLICES: tl.constexpr, HAS_PERM: tl.constexpr, ASM: tl.constexpr):
    """(d [BN, KC, 16] = sum over group gi's planes of (128 + q) x, xs [KC, 16] = sum of x) for token m.
    Group gi is slices gi * SLICES .. + SLICES - 1; slice u's planes u (even channels) and u + 4 (odd)."""
    d = tl.zeros(qw.shape, dtype=tl.float32)
    xs = tl.zeros([qw.shape[1], 16], dtype=tl.float32)
    for jj in tl.static_range(2 * SLICES):
        u = gi * SLICES + jj % SLICES  # the slice
        h = jj // SLICES  # the half: plane u + 4h holds channels 32u + 2w + h
        k_idx = chunk[:, None] * 128 + 32 * u + h + 2 * offs_w[None, :]  # [KC, 16]
        if HAS_PERM:
            k_idx = tl.load(perm_ptr + k_idx, mask=c_mask[:, None], other=0)
        xj = tl.load(x_ptr + m * stride_xm + k_idx, mask=c_mask[:, None] & (m < M), other=0.0).to(tl.float32)
        d += plane_f32(qw, high, u + 4 * h, ASM) * xj[None, :, :]
        xs += xj
    return d, xs


@triton.jit(do_not_specialize=["M", "split_k"])
def _w4a16_gemv_kblock_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, part_ptr, counters_ptr,
                              M, N, num_chunks, stride_xm, stride_qn, stride_sg, stride_zg, stride_om,
                              split_k, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                              K_CHUNKS: tl.constexpr, HAS_PERM: tl.constexpr, ASM: tl.constexpr,
                              PDL: tl.constexpr = False):
    """Grid (cdiv(N, BLOCK_N), split_k); BLOCK_M is 1 or 2 (M <= BLOCK_M). The first block's words
    are loaded before the PDL wait (pdl.py), each next block's at the end of the step before it."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    n_mask = offs_n < N
    offs_c = tl.arange(0, K_CHUNKS)  # [KC]
    offs_w = tl.arange(0, 16)
    NG: tl.constexpr = 128 // GROUP  # groups per chunk
    SLICES: tl.constexpr = GROUP // 32  # 32-channel slices (two nibble planes each) per group
    b_lo, b_hi = split_range(pid_k, tl.cdiv(num_chunks, K_CHUNKS), split_k)
    acc0 = tl.zeros([BLOCK_N, K_CHUNKS, 16], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, K_CHUNKS, 16], dtype=tl.float32)
    rows = qw_ptr + offs_n[:, None, None] * stride_qn + offs_w[None, None, :]  # [BN, 1, 16]
    chunk = b_lo * K_CHUNKS + offs_c  # [KC]
    w_mask = n_mask[:, None, None] & (chunk < num_chunks)[None, :, None] & (b_lo < b_hi)
    qw = tl.load(rows + chunk[None, :, None] * 16, mask=w_mask, other=0)  # [BN, KC, 16] int32
    pdl.enter(PDL)
    for b in range(b_lo, b_hi):
        chunk = b * K_CHUNKS + offs_c  # [KC]
        c_mask = chunk < num_chunks
        high = qw >> 16
        sz_mask = n_mask[:, None] & c_mask[None, :]  # [BN, KC]
        for gi in tl.static_range(NG):
            g = chunk * NG + gi  # [KC] group index
            s = tl.load(s_ptr + g[None, :] * stride_sg + offs_n[:, None], mask=sz_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g[None, :] * stride_zg + offs_n[:, None], mask=sz_mask, other=0).to(tl.float32) + 128.0
            d, xs = _group_terms(qw, high, x_ptr, perm_ptr, 0, M, stride_xm, chunk, c_mask, offs_w, gi, SLICES,
                                 HAS_PERM, ASM)
            acc0 += s[:, :, None] * (d - z[:, :, None] * xs[None, :, :])
            if BLOCK_M == 2:
                d, xs = _group_terms(qw, high, x_ptr, perm_ptr, 1, M, stride_xm, chunk, c_mask, offs_w, gi, SLICES,
                                     HAS_PERM, ASM)
                acc1 += s[:, :, None] * (d - z[:, :, None] * xs[None, :, :])
        nxt = chunk + K_CHUNKS
        w_mask = n_mask[:, None, None] & (nxt < num_chunks)[None, :, None] & (b + 1 < b_hi)
        qw = tl.load(rows + nxt[None, :, None] * 16, mask=w_mask, other=0)
    y0 = tl.sum(tl.sum(acc0, axis=2), axis=1)  # [BN]
    acc = tl.where(offs_m[None, :] == 0, y0[:, None], 0.0)  # [BN, BM]
    if BLOCK_M == 2:
        y1 = tl.sum(tl.sum(acc1, axis=2), axis=1)
        acc = tl.where(offs_m[None, :] == 1, y1[:, None], acc)
    store_tile(acc, out_ptr, part_ptr, counters_ptr, offs_n, offs_m, M, N, stride_om, pid_n, pid_k, split_k)


def w4a16_gemv_kblock(x2: torch.Tensor, w, out: torch.Tensor, block_n: int, k_chunks: int, split_k: int,
                      num_warps: int, num_stages: int = 1, asm: bool | None = None) -> torch.Tensor:
    """out [M, N] = x2 [M, K] @ dequant(w)^T for M <= 2 and paired-order weights (w: W4A16Weights; inputs
    checked by w4a16_gemm.w4a16_linear). k_chunks: a power of two; asm: as w4a16_gemv's."""
    m, k = x2.shape
    n = w.out_features
    if not 1 <= m <= 2:
        raise ValueError(f"w4a16_gemv_kblock: M must be 1 or 2, got {m}")
    if not w.sliced:
        raise ValueError("w4a16_gemv_kblock needs weights in the paired code order (W4A16Weights.sliced)")
    if k_chunks < 1 or k_chunks & (k_chunks - 1):
        raise ValueError(f"w4a16_gemv_kblock: k_chunks must be a power of two, got {k_chunks}")
    chunks = k // 128
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(split_k, triton.cdiv(chunks, k_chunks)))
    part, counters = splitk_buffers(split, m, n, tiles, w.splitk_counters, x2.device)
    perm = w.perm if w.perm is not None else w.qweight
    _w4a16_gemv_kblock_kernel[(tiles, split)](
        x2, w.qweight, w.scales, w.zeros, perm, out, part, counters,
        m, n, chunks, x2.stride(0), w.qweight.stride(0), w.scales.stride(0), w.zeros.stride(0), out.stride(0),
        split, GROUP=w.group_size, BLOCK_N=block_n, BLOCK_M=m, K_CHUNKS=k_chunks,
        HAS_PERM=w.perm is not None, ASM=paired_default() if asm is None else asm,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch(x2.device))
    return out
