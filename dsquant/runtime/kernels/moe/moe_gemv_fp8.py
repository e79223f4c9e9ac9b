"""FP8 block expert GEMV (W8A8) for decode-sized MoE batches: moe_gemv's per-pair structure for
DeepSeek-V3 block experts, no moe_align pass, no MMA.

Not dispatched by fused_moe: on the H200 (V2-Lite layer, T = 1) it took 32.5 | 17.6 us for gate/up
| down against the grouped MMA kernel's 15.4 | 9.6 us plus a 5.2 us align (the per-element
e4m3 -> fp32 conversion and in-kernel quantization cost more than the align saves). Kept for
`dsquant bench moe --sweep fp8`, which times both.

Layouts: weight float8_e4m3fn [E, N_rows, K] (N_rows = 2N for a stacked gate/up w13), scale_inv
fp32 [E, ceil(N_rows/128), ceil(K/128)] (moe_gemm's "fp8"); a [rows, K] bf16/fp16 with unit
column stride, quantized in the kernel, or already quantized: a float8_e4m3fn [rows, K] with
a_scale fp32 [rows, ceil(K/128)]; topk_ids [T, top_k] (pair p = t * top_k + j, a row
p // a_row_div); out [P, N] in the activation dtype (bf16/fp16).
One program per (pair, BLOCK_N output rows, K split) walks its split's 128-wide K blocks, two
weight blocks [BLOCK_N, 128] in flight, and per block kb
  - quantizes a[row, kb-block] with fp8_quant.quant_group_fp8 (the arithmetic of
    quantize_act_fp8: scale = max(amax, 1e-10) / 448, codes = e4m3(x / scale)), or loads the
    pre-quantized block and its scale (A_MODE 0; the Triton interpreter mis-rounds in-kernel fp8
    casts, so CPU runs quantize with torch first),
  - adds (sum_k w[n, k] * xq[k]) * scale_inv[e, n // 128, kb] * x_scale[kb] to an fp32 [BN]
    sum (fp8 products are exact in fp32): the W8A8 arithmetic of the grouped fp8 GEMM.
Gated programs do the same for the up rows (N further down) with the same quantized block. The
sums go to moe_gemv.pair_epilogue (split-K reduction, silu-mul or routing weight, store).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels.gemm.fp8_quant import quant_group_fp8
from dsquant.runtime.kernels.moe.moe_gemm import GroupedWeight
from dsquant.runtime.kernels.moe.moe_gemv import check_pair_gemv, pair_epilogue, pair_launch
from dsquant.runtime.kernels.gemm.splitk import split_range


@triton.jit
def _w_block(w_row_ptrs, mask, kb, K, EVEN_K: tl.constexpr):
    """Weight block kb: [BN, 128] e4m3, each row's 128 bytes contiguous (masked rows read 0)."""
    offs_k = kb * 128 + tl.arange(0, 128)  # [128]
    if EVEN_K:
        return tl.load(w_row_ptrs + offs_k[None, :], mask=mask[:, None], other=0.0)
    return tl.load(w_row_ptrs + offs_k[None, :], mask=mask[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _act_block(a_ptr, a_off, as_ptr, as_off, kb, K, A_MODE: tl.constexpr):
    """Activation block kb as fp32 e4m3 values [128] and its scale (scalar)."""
    offs_k = kb * 128 + tl.arange(0, 128)  # [128]
    x = tl.load(a_ptr + a_off + offs_k, mask=offs_k < K, other=0.0)
    if A_MODE == 0:
        return x.to(tl.float32), tl.load(as_ptr + as_off + kb)
    q, scale = quant_group_fp8(x.to(tl.float32), 0)
    return q.to(tl.float32), scale


@triton.jit(do_not_specialize=["split_k"])  # one compile for every split factor
def _moe_gemv_fp8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, counters_ptr, topk_w_ptr,
                         ids_ptr, N, K, a_row_div, stride_am, stride_asm, stride_we, stride_wn,
                         stride_se, stride_s1, stride_s2, stride_om, split_k, A_MODE: tl.constexpr,
                         GATED: tl.constexpr, ROUTED: tl.constexpr, EVEN_K: tl.constexpr,
                         BLOCK_N: tl.constexpr, ELEMENTWISE: tl.constexpr = False):
    """Grid (P, cdiv(N, BLOCK_N), split_k); layouts in the module docstring, part fp32
    [split_k, P, 2 or 1, N] (moe_gemv.pair_epilogue); A_MODE 0: a e4m3 + a_scale, 1: a bf16/fp16.
    ELEMENTWISE (128 % BLOCK_N == 0, so a program's rows share each weight scale): the activation
    block times x_scale * w_scale as one [128] vector, acc [BN, 128] += w * xe elementwise and one
    reduction at the end, instead of a cross-thread sum per block (fp8_gemv_kblock.py's form)."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    row = (pair // a_row_div).to(tl.int64)
    a_off = row * stride_am
    as_off = row * stride_asm
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    u_rows = w_rows + N * stride_wn  # up rows of a stacked w13
    ws_rows = ws_ptr + expert * stride_se + (offs_n // 128) * stride_s1  # [BN], + kb * stride_s2
    us_rows = ws_ptr + expert * stride_se + ((offs_n + N) // 128) * stride_s1
    kb_lo, kb_hi = split_range(pid_k, tl.cdiv(K, 128), split_k)
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    y_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N, 128], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, 128], dtype=tl.float32)
    ws_blk = ws_ptr + expert * stride_se + (pid_n * BLOCK_N // 128) * stride_s1  # ELEMENTWISE: + kb * stride_s2
    us_blk = ws_ptr + expert * stride_se + ((pid_n * BLOCK_N + N) // 128) * stride_s1
    m0 = n_mask & (kb_lo < kb_hi)
    m1 = n_mask & (kb_lo + 1 < kb_hi)
    w0 = _w_block(w_rows, m0, kb_lo, K, EVEN_K)  # [BN, 128] e4m3
    w1 = _w_block(w_rows, m1, kb_lo + 1, K, EVEN_K)
    if GATED:
        u0 = _w_block(u_rows, m0, kb_lo, K, EVEN_K)
        u1 = _w_block(u_rows, m1, kb_lo + 1, K, EVEN_K)
    for kb in range(kb_lo, kb_hi):
        ahead = n_mask & (kb + 2 < kb_hi)
        w2 = _w_block(w_rows, ahead, kb + 2, K, EVEN_K)
        xq, x_s = _act_block(a_ptr, a_off, as_ptr, as_off, kb, K, A_MODE)  # [128], scalar
        if ELEMENTWISE:
            acc += w0.to(tl.float32) * (xq * (x_s * tl.load(ws_blk + kb * stride_s2)))[None, :]
        else:
            w_s = tl.load(ws_rows + kb * stride_s2, mask=n_mask, other=0.0)  # [BN]
            y += tl.sum(w0.to(tl.float32) * xq[None, :], axis=1) * (w_s * x_s)
        w0 = w1
        w1 = w2
        if GATED:
            u2 = _w_block(u_rows, ahead, kb + 2, K, EVEN_K)
            if ELEMENTWISE:
                acc_up += u0.to(tl.float32) * (xq * (x_s * tl.load(us_blk + kb * stride_s2)))[None, :]
            else:
                u_s = tl.load(us_rows + kb * stride_s2, mask=n_mask, other=0.0)  # [BN]
                y_up += tl.sum(u0.to(tl.float32) * xq[None, :], axis=1) * (u_s * x_s)
            u0 = u1
            u1 = u2
    if ELEMENTWISE:
        y = tl.sum(acc, axis=1)
        y_up = tl.sum(acc_up, axis=1)
    if not GATED:
        y_up = y
    pair_epilogue(y, y_up, out_ptr, part_ptr, counters_ptr, topk_w_ptr, pair, pid_n, pid_k, split_k,
                  offs_n, N, stride_om, GATED, ROUTED)


def moe_gemv_fp8(a: torch.Tensor, w: GroupedWeight, topk_ids: torch.Tensor, out: torch.Tensor,
                 a_row_div: int, gated: bool, topk_weights: torch.Tensor | None = None,
                 a_scale: torch.Tensor | None = None, block_n: int = 16, num_warps: int = 2,
                 split_k: int | None = None, elementwise: bool = False) -> torch.Tensor:
    """out [P, N or N/2 when gated] for the P = topk_ids.numel() pairs (see module docstring).
    a bf16/fp16 (quantized in the kernel; GPU only) or float8_e4m3fn with a_scale; split_k None:
    moe_gemv.default_split_k; counters come from (and stay zero in) w.splitk_counters.
    elementwise: the kernel's ELEMENTWISE form (block_n must divide 128; not yet timed)."""
    pairs, n_out = check_pair_gemv("moe_gemv_fp8", a, w, topk_ids, out, a_row_div, gated, "fp8")
    is_fp8 = a.dtype == torch.float8_e4m3fn
    if is_fp8 and (a_scale is None or tuple(a_scale.shape) != (a.shape[0], triton.cdiv(w.k, 128))
                   or a_scale.stride(1) != 1):
        raise ValueError(f"moe_gemv_fp8: an fp8 a needs a_scale fp32 [{a.shape[0]}, {triton.cdiv(w.k, 128)}] "
                         f"with unit column stride, got {None if a_scale is None else tuple(a_scale.shape)}")
    if not is_fp8 and a.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"moe_gemv_fp8: a must be bf16/fp16 or float8_e4m3fn, got {a.dtype}")
    if gated and n_out % 128:
        raise ValueError(f"moe_gemv_fp8: gated w13 needs N = intermediate % 128 == 0, got {n_out}")
    if elementwise and 128 % block_n:
        raise ValueError(f"moe_gemv_fp8: the elementwise form needs block_n dividing 128, got {block_n}")
    if pairs == 0:
        return out
    ids = topk_ids.reshape(-1)
    tw = topk_weights.reshape(-1).float() if topk_weights is not None else w.scales
    a_s = a_scale if is_fp8 else w.scales  # a stub pointer when quantizing in the kernel
    grid, split, part, counters = pair_launch(w, pairs, n_out, block_n, split_k, gated, a.device)
    _moe_gemv_fp8_kernel[grid](a, a_s, w.weight, w.scales, out, part, counters, tw, ids, n_out, w.k,
                               a_row_div, a.stride(0), a_s.stride(0), w.weight.stride(0),
                               w.weight.stride(1), w.scales.stride(0), w.scales.stride(1),
                               w.scales.stride(2), out.stride(0), split, A_MODE=0 if is_fp8 else 1, GATED=gated,
                               ROUTED=topk_weights is not None, EVEN_K=w.k % 128 == 0,
                               BLOCK_N=block_n, ELEMENTWISE=elementwise, num_warps=num_warps)
    return out
