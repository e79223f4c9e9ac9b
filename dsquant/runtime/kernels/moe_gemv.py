"""INT4 expert GEMV for decode-sized MoE batches (a few (token, expert) pairs): no alignment, no MMA.

Pairs p = t * top_k + j come straight from topk_ids [T, top_k] (expert = topk_ids.flat[p]); no
moe_align pass. One program per (pair, BLOCK_N output channels) walks all of K:
    out[p, n] = sum_k a[p // a_row_div, k] * W_e[n, k]
with the epilogues of moe_gemm: gated (w13 = gate rows [0, N) then up rows [N, 2N); out [P, N] =
silu(gate) * up) or routed (out [P, N] = acc * topk_weights.flat[p]). Rows of `a` are bf16/fp16
with unit column stride; out [P, N] in a's dtype.
Weights: moe_gemm's "int4" layout (fused_moe_int4.py): qweight int32 [E, N/16, K/128, 16, 16],
where word i of row r in 128-channel tile t holds, in nibble j, channel 128t + 16j + i; scales
[E, K/G, N] (activation dtype), zeros uint8 [E, K/G, N].
Per tile, nibble plane j is a [BLOCK_N, 16] block whose columns are 16 consecutive channels, so
each thread multiplies the words it holds by a contiguous slice of a, in fp32 FMAs, and keeps a
[BLOCK_N, 16] running sum (one cross-thread reduction at the end). Codes become 128 + q by placing
them at bits 16..19 of fp32 128.0 (0x43000000, unit in the last place 2^-16); per group
    sum (q - z) s a = s * (sum (128 + q) a - (128 + z) * sum a).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels.activation import silu_mul_as_reference
from dsquant.runtime.kernels.moe_gemm import GroupedWeight, _int4_tile

MOE_GEMV_MAX_PAIRS = 16  # fused_moe takes the GEMV for at most this many (token, expert) pairs


@triton.jit
def _plane_f32(packed, J: tl.constexpr):
    """Nibble plane J of int32 words -> fp32 128 + q (same shape)."""
    SHIFT: tl.constexpr = 16 - 4 * J
    if SHIFT >= 0:
        bits = (packed << SHIFT) & 0xF0000
    else:
        bits = (packed >> (-SHIFT)) & 0xF0000
    return (bits | 0x43000000).to(tl.float32, bitcast=True)


@triton.jit
def _tile_dot(acc, packed, a_ptr, a_off, k0, s_ptr, z_ptr, s_off, n_mask, stride_s1,
              GROUP: tl.constexpr):
    """acc [BN, 16] += scaled partial sums of one 128-channel tile (packed [BN, 16] words)."""
    PLANES: tl.constexpr = GROUP // 16  # nibble planes per quantization group
    i = tl.arange(0, 16)
    for gi in tl.static_range(8 // PLANES):
        part = tl.zeros_like(acc)  # [BN, 16]
        a_sum = tl.zeros([16], dtype=tl.float32)
        for jj in tl.static_range(PLANES):
            a_j = tl.load(a_ptr + a_off + k0 + 16 * (gi * PLANES + jj) + i).to(tl.float32)  # [16]
            part += _plane_f32(packed, gi * PLANES + jj) * a_j[None, :]
            a_sum += a_j
        g = (k0 + 16 * gi * PLANES) // GROUP
        s = tl.load(s_ptr + s_off + g * stride_s1, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
        z = tl.load(z_ptr + s_off + g * stride_s1, mask=n_mask, other=0).to(tl.float32) + 128.0
        acc += s[:, None] * (part - z[:, None] * a_sum[None, :])
    return acc


@triton.jit
def _moe_gemv_kernel(a_ptr, w_ptr, s_ptr, z_ptr, out_ptr, topk_w_ptr, ids_ptr, N, K, a_row_div,
                     stride_am, stride_we, stride_wc, stride_se, stride_s1, stride_s2, stride_om,
                     GROUP: tl.constexpr, GATED: tl.constexpr, ROUTED: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    a_off = (pair // a_row_div).to(tl.int64) * stride_am
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    s_off = expert * stride_se + offs_n * stride_s2  # [BN]
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    # tiles k0 and k0 + 128 are in flight while k0 is computed (few programs per SM at decode:
    # the loads, not the FMAs, set the pace); up rows are N further down the same expert
    p0 = _int4_tile(w_ptr, expert, offs_n, n_mask, 0, stride_we, stride_wc)  # [BN, 16]
    p1 = _int4_tile(w_ptr, expert, offs_n, n_mask & (128 < K), 128, stride_we, stride_wc)
    if GATED:
        u0 = _int4_tile(w_ptr, expert, offs_n + N, n_mask, 0, stride_we, stride_wc)
        u1 = _int4_tile(w_ptr, expert, offs_n + N, n_mask & (128 < K), 128, stride_we, stride_wc)
    for k0 in range(0, K, 128):
        ahead = n_mask & (k0 + 256 < K)
        p2 = _int4_tile(w_ptr, expert, offs_n, ahead, k0 + 256, stride_we, stride_wc)
        acc = _tile_dot(acc, p0, a_ptr, a_off, k0, s_ptr, z_ptr, s_off, n_mask, stride_s1, GROUP)
        p0 = p1
        p1 = p2
        if GATED:
            u2 = _int4_tile(w_ptr, expert, offs_n + N, ahead, k0 + 256, stride_we, stride_wc)
            acc_up = _tile_dot(acc_up, u0, a_ptr, a_off, k0, s_ptr, z_ptr, s_off + N * stride_s2,
                               n_mask, stride_s1, GROUP)
            u0 = u1
            u1 = u2
    y = tl.sum(acc, axis=1)  # [BN]
    if GATED:
        y = silu_mul_as_reference(y, tl.sum(acc_up, axis=1), out_ptr.dtype.element_ty)
    if ROUTED:
        y = y * tl.load(topk_w_ptr + pair)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


def moe_gemv_int4(a: torch.Tensor, w: GroupedWeight, topk_ids: torch.Tensor, out: torch.Tensor,
                  a_row_div: int, gated: bool, topk_weights: torch.Tensor | None = None,
                  block_n: int = 32, num_warps: int = 2) -> torch.Tensor:
    """out [P, N or N/2 when gated] for the P = topk_ids.numel() pairs (see module docstring)."""
    if w.format != "int4":
        raise ValueError(f"moe_gemv_int4 needs int4 experts, got {w.format!r}")
    n_out = w.n // 2 if gated else w.n
    pairs = topk_ids.numel()
    if a.shape[1] != w.k or a.stride(1) != 1 or tuple(out.shape) != (pairs, n_out) or out.stride(1) != 1:
        raise ValueError(f"moe_gemv_int4 shapes: a {tuple(a.shape)}, weight n={w.n} k={w.k}, "
                         f"out {tuple(out.shape)}, expected [{pairs}, {n_out}]")
    if a.shape[0] * a_row_div != pairs:
        raise ValueError(f"a has {a.shape[0]} rows; with a_row_div {a_row_div} it must cover {pairs} pairs")
    if pairs == 0:
        return out
    ids = topk_ids.reshape(-1)
    tw = topk_weights.reshape(-1).float() if topk_weights is not None else a
    grid = (pairs, triton.cdiv(n_out, block_n))
    _moe_gemv_kernel[grid](a, w.weight, w.scales, w.zeros, out, tw, ids, n_out, w.k, a_row_div,
                           a.stride(0), w.weight.stride(0), w.weight.stride(1), w.scales.stride(0),
                           w.scales.stride(1), w.scales.stride(2), out.stride(0),
                           GROUP=w.group_size, GATED=gated, ROUTED=topk_weights is not None,
                           BLOCK_N=block_n, num_warps=num_warps)
    return out
