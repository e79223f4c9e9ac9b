"""FP8 block GEMV (W8A8) on an activation quantized once: y = dequant(xq) @ dequant(W)^T for 1 or 2
tokens, K_BLOCKS 128-wide K blocks a step, no tensor cores.

Layouts (DeepSeek-V3, as fp8_gemm.py): weight float8_e4m3fn [N, K] contiguous along K, K % 128 == 0;
weight_scale_inv fp32 [ceil(N/128), K/128]; xq float8_e4m3fn [M, K] with x_scale fp32 [M, K/128]
(fp8_quant.per_token_group_quant_fp8: the same per-128 quantization as every W8A8 path); y [M, N]
bf16/fp16 (unit column stride). BLOCK_N divides 128, so one program's rows share each weight
scale.

Why (H200, scripts/fp8_decode_probe.py, 2026-12-04): fp8_gemv.py reduces every 128-block across
threads and, quantizing x itself, repeats that quantization's IEEE divisions in every thread that
shares a column; on V2-Lite's 2048 x 2048 it moved 0.7 TB/s on an already-quantized x. Here a step
loads a [BLOCK_N, K_BLOCKS * 128] run of each row (K_BLOCKS * 128 contiguous bytes), the activation
side is one 1D vector, xe[k] = xq[k] * x_scale[k // 128] * w_scale[k // 128], broadcast over the
rows (no layout conversion), and acc [BLOCK_N, K_BLOCKS * 128] += w * xe stays elementwise until
one reduction at the end. The products are those of the other W8A8 paths (each weight times its
dequantized activation, fp32); only the summation order differs.

FUSE_QUANT: x is bf16/fp16 [M, K] (x_scale unused) and each program quantizes the activation runs
it reads with fp8_quant.quant_group_fp8, the arithmetic of per_token_group_quant_fp8, so no
quantization launch precedes the GEMV. The step is then laid out [BLOCK_N, K_BLOCKS, 128] so each
128-group's amax is one reduction over the last axis.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.gemm.fp8_quant import quant_group_fp8
from dsquant.runtime.kernels.gemm.splitk import split_range, splitk_buffers, store_tile


@triton.jit
def _x_eff(xq_ptr, xs_ptr, w_s, m, M, cols, c_mask, stride_xm, stride_xsm):
    """xe [KB * 128] fp32: token m's dequantized activation times the weight scale of each column;
    0 past K (c_mask false), where the step's tail must read nothing: an fp8 byte or a scale
    beyond the row may be NaN, and 0 * NaN would poison the sum."""
    live = c_mask & (m < M)
    xq = tl.load(xq_ptr + m * stride_xm + cols, mask=live, other=0.0).to(tl.float32)
    xs = tl.load(xs_ptr + m * stride_xsm + cols // 128, mask=live, other=0.0)
    return xq * (xs * w_s)


@triton.jit
def _x_eff_fused(x_ptr, w_s, m, M, cols, c_mask, stride_xm):
    """xe [KB, 128] fp32 for FUSE_QUANT: token m's 16-bit activation at cols [KB, 128], quantized per
    128-group as per_token_group_quant_fp8 does, dequantized, times the weight scale w_s [KB]."""
    x = tl.load(x_ptr + m * stride_xm + cols, mask=c_mask & (m < M), other=0.0).to(tl.float32)
    q, x_s = quant_group_fp8(x, 1)  # [KB, 128] e4m3, [KB]
    return q.to(tl.float32) * (x_s * w_s)[:, None]


@triton.jit
def _fused_steps(x_ptr, w_rows, ws_row, M, K, s_lo, s_hi, stride_xm,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, K_BLOCKS: tl.constexpr, PDL: tl.constexpr):
    """FUSE_QUANT main loop over steps [s_lo, s_hi) -> (y0, y1) [BN] fp32, token 0's and token 1's.
    The first step's weights are loaded before the PDL wait, each next step's at the end of the one before."""
    offs_b = tl.arange(0, K_BLOCKS)
    offs_c = tl.arange(0, 128)
    acc0 = tl.zeros([BLOCK_N, K_BLOCKS, 128], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, K_BLOCKS, 128], dtype=tl.float32)
    cols = (s_lo * K_BLOCKS + offs_b)[:, None] * 128 + offs_c[None, :]  # [KB, 128]
    w = tl.load(w_rows[:, :, None] + cols[None, :, :], mask=(cols < K)[None, :, :] & (s_lo < s_hi), other=0.0)
    pdl.enter(PDL)
    for st in range(s_lo, s_hi):
        blk = st * K_BLOCKS + offs_b  # [KB] 128-block index
        cols = blk[:, None] * 128 + offs_c[None, :]  # [KB, 128]
        c_mask = cols < K
        w_s = tl.load(ws_row + blk, mask=blk * 128 < K, other=0.0)  # [KB]
        wf = w.to(tl.float32)  # [BN, KB, 128]
        acc0 += wf * _x_eff_fused(x_ptr, w_s, 0, M, cols, c_mask, stride_xm)[None, :, :]
        if BLOCK_M == 2:
            acc1 += wf * _x_eff_fused(x_ptr, w_s, 1, M, cols, c_mask, stride_xm)[None, :, :]
        nxt = cols + K_BLOCKS * 128
        w = tl.load(w_rows[:, :, None] + nxt[None, :, :], mask=(nxt < K)[None, :, :] & (st + 1 < s_hi), other=0.0)
    return tl.sum(tl.sum(acc0, axis=2), axis=1), tl.sum(tl.sum(acc1, axis=2), axis=1)


@triton.jit(do_not_specialize=["M", "split_k"])
def _fp8_gemv_kblock_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, counters_ptr,
                            M, N, K, stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om, split_k,
                            BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, K_BLOCKS: tl.constexpr,
                            FUSE_QUANT: tl.constexpr = False, PDL: tl.constexpr = False):
    """Grid (cdiv(N, BLOCK_N), split_k); BLOCK_M 1 or 2; steps of K_BLOCKS * 128 columns, the last
    one masked."""
    STEP: tl.constexpr = K_BLOCKS * 128
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    # rows past N read row N - 1 (never stored): the weight loads need no row mask
    w_rows = w_ptr + tl.minimum(offs_n, N - 1)[:, None] * stride_wn  # [BN, 1]
    ws_row = ws_ptr + (pid_n * BLOCK_N // 128) * stride_wsn  # this program's row block of scales
    offs_s = tl.arange(0, STEP)  # [STEP]
    s_lo, s_hi = split_range(pid_k, tl.cdiv(K, STEP), split_k)
    if FUSE_QUANT:
        y0, y1 = _fused_steps(xq_ptr, w_rows, ws_row, M, K, s_lo, s_hi, stride_xm, BLOCK_N, BLOCK_M, K_BLOCKS, PDL)
    else:
        acc0 = tl.zeros([BLOCK_N, STEP], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, STEP], dtype=tl.float32)
        cols = s_lo * STEP + offs_s  # [STEP]
        w = tl.load(w_rows + cols[None, :], mask=(cols < K)[None, :] & (s_lo < s_hi), other=0.0)  # [BN, STEP]
        pdl.enter(PDL)  # the first step's weights are read before the wait (pdl.py)
        for st in range(s_lo, s_hi):
            cols = st * STEP + offs_s  # [STEP]
            c_mask = cols < K
            w_s = tl.load(ws_row + cols // 128, mask=c_mask, other=0.0)  # [STEP]
            wf = w.to(tl.float32)
            acc0 += wf * _x_eff(xq_ptr, xs_ptr, w_s, 0, M, cols, c_mask, stride_xm, stride_xsm)[None, :]
            if BLOCK_M == 2:
                acc1 += wf * _x_eff(xq_ptr, xs_ptr, w_s, 1, M, cols, c_mask, stride_xm, stride_xsm)[None, :]
            nxt = cols + STEP
            w = tl.load(w_rows + nxt[None, :], mask=(nxt < K)[None, :] & (st + 1 < s_hi), other=0.0)
        y0, y1 = tl.sum(acc0, axis=1), tl.sum(acc1, axis=1)
    acc = tl.where(offs_m[None, :] == 0, y0[:, None], 0.0)  # [BN, BM]
    if BLOCK_M == 2:
        acc = tl.where(offs_m[None, :] == 1, y1[:, None], acc)
    store_tile(acc, out_ptr, part_ptr, counters_ptr, offs_n, offs_m, M, N, stride_om, pid_n, pid_k, split_k)


def fp8_gemv_kblock(xq: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor,
                    weight_scale_inv: torch.Tensor, out: torch.Tensor, block_n: int, k_blocks: int, split_k: int,
                    num_warps: int, num_stages: int = 1, splitk_counters: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] = dequant(xq) [M, K] @ dequant(weight)^T for M <= 2 (see the module docstring);
    x_scale None: xq is the bf16/fp16 activation, quantized in the kernel (FUSE_QUANT).
    `splitk_counters` (int32, zero, >= ceil(N / block_n) entries) is left zero."""
    m, k = xq.shape
    n = weight.shape[0]
    fused = x_scale is None
    if not 1 <= m <= 2:
        raise ValueError(f"fp8_gemv_kblock: xq must have 1 or 2 rows (tokens), got {m}")
    if fused and xq.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_gemv_kblock: without x_scale, xq must be the bf16/fp16 activation, got {xq.dtype}")
    if not fused and (xq.dtype != torch.float8_e4m3fn or tuple(x_scale.shape) != (m, triton.cdiv(k, 128))):
        raise ValueError(f"fp8_gemv_kblock: xq must be float8_e4m3fn [M, K] with x_scale [{m}, {triton.cdiv(k, 128)}], "
                         f"got {xq.dtype} {tuple(xq.shape)} and {tuple(x_scale.shape)}")
    if k % 128 or tuple(weight.shape) != (n, k) or weight.stride(1) != 1:
        raise ValueError(f"fp8_gemv_kblock: weight must be [N, K] contiguous along K with K % 128 == 0, "
                         f"got {tuple(weight.shape)} for K = {k}")
    if block_n < 16 or 128 % block_n or k_blocks < 1 or k_blocks & (k_blocks - 1):
        raise ValueError(f"fp8_gemv_kblock: block_n must be a power of two in 16..128 and k_blocks a power of "
                         f"two, got {block_n}, {k_blocks}")
    xs = xq if fused else x_scale  # unread under FUSE_QUANT
    if xq.stride(1) != 1 or xs.stride(1) != 1 or out.stride(1) != 1 or tuple(out.shape) != (m, n):
        raise ValueError(f"fp8_gemv_kblock: xq, x_scale and out [{m}, {n}] need unit column strides")
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(split_k, triton.cdiv(k, 128 * k_blocks)))
    part, counters = splitk_buffers(split, m, n, tiles, splitk_counters, xq.device)
    _fp8_gemv_kblock_kernel[(tiles, split)](
        xq, xs, weight, weight_scale_inv, out, part, counters, m, n, k,
        xq.stride(0), xs.stride(0), weight.stride(0), weight_scale_inv.stride(0), out.stride(0), split,
        BLOCK_N=block_n, BLOCK_M=m, K_BLOCKS=k_blocks, FUSE_QUANT=fused, num_warps=num_warps,
        num_stages=num_stages, **pdl.launch(xq.device))
    return out
