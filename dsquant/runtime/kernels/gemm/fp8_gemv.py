"""FP8 block GEMV (W8A8) for decode batches of 1..4 tokens: y = x @ W^T without tensor cores.

Layouts (DeepSeek-V3, as fp8_gemm.py): weight float8_e4m3fn [N, K], contiguous along K;
weight_scale_inv fp32 [ceil(N/128), ceil(K/128)]; x [M, K] bf16/fp16 with unit column stride,
or already quantized (x_fp8 [M, K] e4m3 + x_scale fp32 [M, ceil(K/128)], any strides);
y [M, N] bf16/fp16 (unit column stride). M <= 4; N and K need not be multiples of 128.

At M <= 4 the MMA path pads the token side to 16 and stages the weight tile through shared
memory; here everything stays in registers. Each program owns BLOCK_N output channels and a run
of 128-wide K blocks (split-K through splitk.store_tile's one-launch epilogue: no memset, CUDA
graph friendly). Per K block kb it
  - loads the weight block [BLOCK_N, 128] e4m3 (each row's 128 bytes contiguous: 16-byte
    vector loads), issued one block ahead of its use so two blocks are in flight per program,
  - converts it to fp32 once for all BLOCK_M tokens,
  - for each token m: quantizes x[m, kb-block] with fp8_quant.quant_group_fp8 (x is tiny; every
    program redoing it costs nothing next to the weight bytes), or loads the pre-quantized block,
    and adds   (sum_k w[n, k] * xq[m, k]) * weight_scale_inv[n // 128, kb] * x_scale[m, kb]
    to the fp32 accumulator: the same W8A8 arithmetic as fp8_gemm.py (fp8 products are exact in
    fp32), without Hopper's reduced-precision FP8 MMA accumulation.
A_MODE: 0 = x pre-quantized (e4m3 + x_scale), 1 = x bf16/fp16 quantized in the kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.gemm.fp8_quant import quant_group_fp8
from dsquant.runtime.kernels.gemm.gemm_configs import FP8_GEMV_MAX_M
from dsquant.runtime.kernels.gemm.splitk import split_range, splitk_buffers, store_tile


@triton.jit
def _token_block_dot(w, w_s, x_ptr, xs_ptr, row, M, kb, offs_k, k_mask, stride_xm, stride_xsm,
                     stride_xsg, A_MODE: tl.constexpr):
    """One token's contribution [BN] from one 128-block: dot(w, xq[row]) * w_s * x_scale."""
    x_mask = k_mask & (row < M)  # [BK]
    x_ptrs = x_ptr + row * stride_xm + offs_k  # [BK]
    if A_MODE == 0:
        xq = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)  # [BK] fp8 values
        x_s = tl.load(xs_ptr + row * stride_xsm + kb * stride_xsg, mask=row < M, other=0.0)
    else:
        x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)  # [BK]
        q, x_s = quant_group_fp8(x, 0)  # [BK] e4m3, scalar scale
        xq = q.to(tl.float32)
    return tl.sum(w * xq[None, :], axis=1) * (w_s * x_s)  # [BN]


@triton.jit
def _load_w_block(w_rows, kb, offs_kk, K, EVEN_K: tl.constexpr):
    """Weight block kb: [BN, 128] e4m3, each row's 128 bytes contiguous."""
    offs_k = kb * 128 + offs_kk  # [BK]
    if EVEN_K:
        return tl.load(w_rows + offs_k[None, :])
    return tl.load(w_rows + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)


@triton.jit(do_not_specialize=["M", "split_k"])  # one compile for any M <= BLOCK_M and any split
def _fp8_gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, counters_ptr,
                     M, N, K, stride_xm, stride_xsm, stride_xsg, stride_wn, stride_wsn, stride_om,
                     split_k, A_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                     EVEN_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    BLOCK_K: tl.constexpr = 128
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    offs_kk = tl.arange(0, BLOCK_K)  # [BK]
    # rows past N read row N - 1 (never stored): the weight loads need no row mask
    w_rows = w_ptr + tl.minimum(offs_n, N - 1)[:, None] * stride_wn  # [BN, 1]
    ws_rows = ws_ptr + (tl.minimum(offs_n, N - 1) // BLOCK_K) * stride_wsn  # [BN]

    num_kb = tl.cdiv(K, BLOCK_K)
    kb_lo, kb_hi = split_range(pid_k, num_kb, split_k)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    w_next = _load_w_block(w_rows, tl.minimum(kb_lo, num_kb - 1), offs_kk, K, EVEN_K)  # [BN, BK]
    for kb in range(kb_lo, kb_hi):
        w8 = w_next  # [BN, BK] e4m3, block kb
        # issue block kb + 1 (the last block again at the end of the run: an L2 hit) before
        # reducing block kb, so two weight blocks are in flight per program
        w_next = _load_w_block(w_rows, tl.minimum(kb + 1, kb_hi - 1), offs_kk, K, EVEN_K)
        w = w8.to(tl.float32)  # [BN, BK]
        w_s = tl.load(ws_rows + kb)  # [BN]
        offs_k = kb * BLOCK_K + offs_kk  # [BK]
        k_mask = offs_k < K
        for m in tl.static_range(BLOCK_M):
            part = _token_block_dot(w, w_s, x_ptr, xs_ptr, m, M, kb, offs_k, k_mask, stride_xm,
                                    stride_xsm, stride_xsg, A_MODE)  # [BN]
            acc += tl.where(offs_m[None, :] == m, part[:, None], 0.0)
    store_tile(acc, out_ptr, part_ptr, counters_ptr, offs_n, offs_m, M, N, stride_om,
               pid_n, pid_k, split_k)


def fp8_gemv(x2: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor,
             weight_scale_inv: torch.Tensor, out: torch.Tensor, block_n: int, split_k: int,
             num_warps: int, num_stages: int = 1,
             splitk_counters: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] = x2 [M, K] @ (weight * weight_scale_inv)^T, W8A8, for M <= FP8_GEMV_MAX_M.

    x2 bf16/fp16 (quantized in the kernel), or float8_e4m3fn with x_scale [M, ceil(K/128)];
    inputs are checked by fp8_gemm.fp8_block_linear. `splitk_counters` (int32, zero, at least
    ceil(N / block_n) entries) is left zero.
    """
    m, k = x2.shape
    n = weight.shape[0]
    if not 1 <= m <= FP8_GEMV_MAX_M:
        raise ValueError(f"fp8_gemv: x must have 1..{FP8_GEMV_MAX_M} rows (tokens), got {m}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"fp8_gemv: block_n must be a power of two >= 16, got {block_n}")
    is_fp8 = x2.dtype == torch.float8_e4m3fn
    if is_fp8 and x_scale is None:
        raise ValueError("fp8_gemv: an fp8 x needs its x_scale [M, ceil(K/128)]")
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(split_k, triton.cdiv(k, 128)))
    part, counters = splitk_buffers(split, m, n, tiles, splitk_counters, x2.device)
    xs = x_scale if is_fp8 else weight_scale_inv  # a stub pointer in A_MODE 1
    _fp8_gemv_kernel[(tiles, split)](
        x2, xs, weight, weight_scale_inv, out, part, counters, m, n, k,
        x2.stride(0), xs.stride(0), xs.stride(1), weight.stride(0), weight_scale_inv.stride(0),
        out.stride(0), split, A_MODE=0 if is_fp8 else 1, BLOCK_N=block_n,
        BLOCK_M=triton.next_power_of_2(m), EVEN_K=k % 128 == 0, num_warps=num_warps, num_stages=num_stages,
        **pdl.launch(x2.device))
    return out
