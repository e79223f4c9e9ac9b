"""INT4 expert GEMV in the K-block form: a program loads K_CHUNKS 128-channel tiles of its rows at once.

The per-pair MoE GEMV (moe_gemv.py) for decode-sized batches, with the loop of the dense K-block GEMV
(gemm/w4a16_gemv_kblock.py): a V2-Lite expert's K (2048 for gate/up, 1408 for down) is one step of
one program per (pair, BLOCK_N rows), so many loads are in flight at once and no split-K reduction
through memory is needed (split_k > 1 still splits the blocks, through moe_gemv.pair_epilogue).

Layouts (moe_gemm "int4", fused_moe_int4.py): qweight int32 [E, N/16, K/128, 16, 16]: in chunk c of
row tile r // 16, word i of row r holds, in nibble j, the code of W[r, 128c + 16j + i]; scales
[E, K/G, N] (activation dtype), zeros uint8 [E, K/G, N] (same strides); a [rows, K] bf16/fp16 with
unit column stride; out [P, N] in a's dtype. Pair p reads expert topk_ids.flat[p] and a row
p // a_row_div. Gated (w13): gate rows [0, N) and up rows [N, 2N), out = silu(gate) * up; routed:
out = acc * topk_weights.flat[p]. K % 128 == 0; G is 32, 64 or 128.

Per block every element of the [BLOCK_N, K_CHUNKS, 16] word tile stays in its thread: nibble plane j
becomes fp32 128 + q (w4a16_gemv.plane_f32), d += (128 + q) a_j with a_j the [K_CHUNKS, 16] activation
slice of plane j, and per quantization group acc += s * (d - (128 + z) * sum_group a), elementwise;
the only cross-thread reduction is the final sum over the last two axes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels.gemm.splitk import split_range
from dsquant.runtime.kernels.gemm.w4a16_gemv import plane_f32
from dsquant.runtime.kernels.gemm.w4a16_mma import paired_default
from dsquant.runtime.kernels.moe.moe_gemm import GroupedWeight
from dsquant.runtime.kernels.moe.moe_gemv import check_pair_gemv, pair_epilogue, pair_launch


@triton.jit
def _words(w_ptr, expert, rows, n_mask, chunk, c_mask, stride_we, stride_wc):
    """Packed words [BN, KC, 16] of weight rows `rows` [BN], 128-channel chunks `chunk` [KC]."""
    row_off = (rows // 16) * stride_wc + (rows % 16) * 16  # [BN]
    ptrs = (w_ptr + expert * stride_we + row_off[:, None, None] + chunk[None, :, None] * 256
            + tl.arange(0, 16)[None, None, :])
    return tl.load(ptrs, mask=n_mask[:, None, None] & c_mask[None, :, None], other=0)


@triton.jit
def _block_dot(acc, qw, a_ptr, a_off, chunk, c_mask, s_ptr, z_ptr, s_rows, sz_mask, stride_s1,
               GROUP: tl.constexpr, ASM: tl.constexpr):
    """acc [BN, KC, 16] += the scaled group terms of one block of words qw [BN, KC, 16]."""
    NG: tl.constexpr = 128 // GROUP  # groups per chunk
    PLANES: tl.constexpr = GROUP // 16  # nibble planes per group
    offs_w = tl.arange(0, 16)
    high = qw >> 16
    for gi in tl.static_range(NG):
        d = tl.zeros(qw.shape, dtype=tl.float32)
        a_sum = tl.zeros([qw.shape[1], 16], dtype=tl.float32)  # [KC, 16]
        for jj in tl.static_range(PLANES):
            k_idx = chunk[:, None] * 128 + 16 * (gi * PLANES + jj) + offs_w[None, :]  # [KC, 16]
            a_j = tl.load(a_ptr + a_off + k_idx, mask=c_mask[:, None], other=0.0).to(tl.float32)
            d += plane_f32(qw, high, gi * PLANES + jj, ASM) * a_j[None, :, :]
            a_sum += a_j
        g = chunk * NG + gi  # [KC] group index
        s = tl.load(s_ptr + s_rows[:, None] + g[None, :] * stride_s1, mask=sz_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + s_rows[:, None] + g[None, :] * stride_s1, mask=sz_mask, other=0).to(tl.float32) + 128.0
        acc += s[:, :, None] * (d - z[:, :, None] * a_sum[None, :, :])
    return acc


@triton.jit(do_not_specialize=["split_k"])
def _moe_gemv_kblock_kernel(a_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, counters_ptr, topk_w_ptr, ids_ptr,
                            N, K, a_row_div, stride_am, stride_we, stride_wc, stride_se, stride_s1, stride_s2,
                            stride_om, split_k, GROUP: tl.constexpr, GATED: tl.constexpr, ROUTED: tl.constexpr,
                            BLOCK_N: tl.constexpr, K_CHUNKS: tl.constexpr, ASM: tl.constexpr):
    """Grid (P, cdiv(N, BLOCK_N), split_k): split pid_k runs its share of the cdiv(K / 128, K_CHUNKS)
    blocks; part fp32 [split_k, P, 2 or 1, N] and counters as moe_gemv.pair_epilogue's."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    a_off = (pair // a_row_div).to(tl.int64) * stride_am
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    s_base = s_ptr + expert * stride_se
    z_base = z_ptr + expert * stride_se
    num_chunks = K // 128
    b_lo, b_hi = split_range(pid_k, tl.cdiv(num_chunks, K_CHUNKS), split_k)
    acc = tl.zeros([BLOCK_N, K_CHUNKS, 16], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, K_CHUNKS, 16], dtype=tl.float32)
    for b in range(b_lo, b_hi):
        chunk = b * K_CHUNKS + tl.arange(0, K_CHUNKS)  # [KC]
        c_mask = chunk < num_chunks
        sz_mask = n_mask[:, None] & c_mask[None, :]  # [BN, KC]
        qw = _words(w_ptr, expert, offs_n, n_mask, chunk, c_mask, stride_we, stride_wc)  # [BN, KC, 16]
        if GATED:  # both tiles' loads issued before either is dequantized
            qu = _words(w_ptr, expert, offs_n + N, n_mask, chunk, c_mask, stride_we, stride_wc)
        acc = _block_dot(acc, qw, a_ptr, a_off, chunk, c_mask, s_base, z_base, offs_n * stride_s2, sz_mask,
                         stride_s1, GROUP, ASM)
        if GATED:
            acc_up = _block_dot(acc_up, qu, a_ptr, a_off, chunk, c_mask, s_base, z_base, (offs_n + N) * stride_s2,
                                sz_mask, stride_s1, GROUP, ASM)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]
    y_up = y
    if GATED:
        y_up = tl.sum(tl.sum(acc_up, axis=2), axis=1)
    pair_epilogue(y, y_up, out_ptr, part_ptr, counters_ptr, topk_w_ptr, pair, pid_n, pid_k, split_k,
                  offs_n, N, stride_om, GATED, ROUTED)


def moe_gemv_int4_kblock(a: torch.Tensor, w: GroupedWeight, topk_ids: torch.Tensor, out: torch.Tensor,
                         a_row_div: int, gated: bool, topk_weights: torch.Tensor | None = None,
                         block_n: int = 16, k_chunks: int | None = None, num_warps: int = 4,
                         split_k: int = 1, _asm: bool | None = None) -> torch.Tensor:
    """out [P, N or N/2 when gated] for the P = topk_ids.numel() pairs (module docstring).
    k_chunks: a power of two (None: all of K in one block); split_k splits the blocks (counters from,
    and left zero in, w.splitk_counters)."""
    pairs, n_out = check_pair_gemv("moe_gemv_int4_kblock", a, w, topk_ids, out, a_row_div, gated, "int4")
    chunks = w.k // 128
    k_chunks = k_chunks or triton.next_power_of_2(chunks)
    if k_chunks < 1 or k_chunks & (k_chunks - 1):
        raise ValueError(f"moe_gemv_int4_kblock: k_chunks must be a power of two, got {k_chunks}")
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    if pairs == 0:
        return out
    blocks = triton.cdiv(chunks, k_chunks)
    split = triton.cdiv(blocks, triton.cdiv(blocks, min(split_k, blocks)))  # no empty split
    grid, split, part, counters = pair_launch(w, pairs, n_out, block_n, split, gated, a.device)
    ids = topk_ids.reshape(-1)
    tw = topk_weights.reshape(-1).float() if topk_weights is not None else a
    _moe_gemv_kblock_kernel[grid](
        a, w.weight, w.scales, w.zeros, out, part, counters, tw, ids, n_out, w.k,
        a_row_div, a.stride(0), w.weight.stride(0), w.weight.stride(1),
        w.scales.stride(0), w.scales.stride(1), w.scales.stride(2), out.stride(0),
        split, GROUP=w.group_size, GATED=gated, ROUTED=topk_weights is not None,
        BLOCK_N=block_n, K_CHUNKS=k_chunks, ASM=paired_default() if _asm is None else _asm,
        num_warps=num_warps)
    return out
