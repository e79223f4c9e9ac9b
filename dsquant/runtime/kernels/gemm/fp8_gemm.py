"""FP8 block-scaled GEMM (DeepSeek-V3 layout): y = x @ W^T with W = weight * weight_scale_inv.

Layouts: weight float8_e4m3fn [N, K]; weight_scale_inv fp32 [ceil(N/128), ceil(K/128)] (one
scale per 128 x 128 block, edge blocks partial); x [M, K] bf16/fp16, or already quantized
(x_fp8 [M, K] e4m3 + x_scale fp32 [M, ceil(K/128)], any strides: fp8_quant.py makes them);
y [M, N] bf16/fp16. N and K need not be multiples of 128.

One program owns an output tile of BLOCK_N channels x BLOCK_M tokens, computed transposed
(acc[n, m]) so the weight tile is the MMA's wide operand, and walks K one 128-block at a time:
    acc += dot(W_blk, A_blk) * weight_scale_inv[n // 128, kb] * x_scale[m, kb]
Each block's dot starts from zero and is promoted into the fp32 accumulator with its scales,
which also keeps Hopper's reduced-precision FP8 accumulation to 128 products.
A_MODE selects what feeds the MMA:
  0  x pre-quantized to e4m3 (prefill: fp8_quant.per_token_group_quant_fp8 runs first)
  1  x in bf16/fp16, quantized per token and block inside the GEMM (decode: one launch, the
     same arithmetic as the separate quantizer)
  2  weight-only: x stays bf16/fp16, the weight block is converted in registers and the MMA is
     bf16/fp16 (GPUs without FP8 tensor cores, sm < 89)
Split-K over the 128-blocks (splitk.store_tile) spreads decode sizes over every multiprocessor.

fp8_block_linear dispatches on the token count (gemm_configs.fp8_config): M <= 4 runs the GEMV of
fp8_gemv.py, prefill on sm_90 (M >= 128, N and K multiples of 128) runs cuBLASLt's blockwise
`torch._scaled_mm` on x quantized by fp8_quant.py, everything else this kernel. The weight scales
go to cuBLAS row-padded (cublas_scale_layout), the layout the runtime stores them in.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.gemm.fp8_gemv import fp8_gemv
from dsquant.runtime.kernels.gemm.fp8_gemv_kblock import fp8_gemv_kblock
from dsquant.runtime.kernels.gemm.fp8_quant import per_token_group_quant_fp8, quant_group_fp8
from dsquant.runtime.kernels.gemm.gemm_configs import (DECODE_MAX_M, FP8_GEMV_MAX_M, GemmConfig,
                                                  fp8_config, fp8_tiled_config, kblock_fuses_quant)
from dsquant.runtime.kernels.gemm.splitk import split_range, splitk_buffers, store_tile, swizzled_tile

FP8_BLOCK = 128
CUBLAS_ROWS = 16  # token counts padded to this for cuBLAS (the bench saw M = 1 refused, 4 taken)


@triton.jit(do_not_specialize=["M", "split_k"])  # one compile for any M and split
def _fp8_block_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, counters_ptr,
                           M, N, K, stride_am, stride_asm, stride_asg, stride_wn, stride_wsn,
                           stride_om, split_k, A_MODE: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_M: tl.constexpr, SWIZZLE: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    BLOCK_K: tl.constexpr = 128
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n, pid_m = swizzled_tile(pid, M, N, BLOCK_M, BLOCK_N, SWIZZLE)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    n_mask = offs_n < N
    m_mask = offs_m < M
    num_kb = tl.cdiv(K, BLOCK_K)
    kb_lo, kb_hi = split_range(pid_k, num_kb, split_k)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
        k_mask = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK] e4m3
        w_s = tl.load(ws_ptr + (offs_n // BLOCK_K) * stride_wsn + kb, mask=n_mask, other=0.0)  # [BN]
        a_ptrs = a_ptr + offs_m[None, :] * stride_am + offs_k[:, None]  # [BK, BM]
        a_mask = m_mask[None, :] & k_mask[:, None]
        if A_MODE == 0:
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)  # [BK, BM] e4m3
            a_s = tl.load(as_ptr + offs_m * stride_asm + kb * stride_asg, mask=m_mask, other=0.0)
            acc += tl.dot(w, a) * w_s[:, None] * a_s[None, :]
        elif A_MODE == 1:
            x = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)  # [BK, BM]
            a, a_s = quant_group_fp8(x, 0)  # [BK, BM] e4m3, [BM]
            acc += tl.dot(w, a) * w_s[:, None] * a_s[None, :]
        else:
            x = tl.load(a_ptrs, mask=a_mask, other=0.0)  # [BK, BM] bf16/fp16
            acc += tl.dot(w.to(x.dtype), x) * w_s[:, None]
    store_tile(acc, out_ptr, part_ptr, counters_ptr, offs_n, offs_m, M, N, stride_om,
               pid, pid_k, split_k)


def has_fp8_mma(device) -> bool:
    """FP8 tensor cores: compute capability 8.9 (Ada) and 9.0+ (Hopper, Blackwell)."""
    d = torch.device(device)
    return d.type == "cuda" and torch.cuda.get_device_capability(d) >= (8, 9)


def _check(weight, weight_scale_inv, k):
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"fp8_block_linear: weight must be float8_e4m3fn [N, K], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, wk = weight.shape
    if wk != k:
        raise ValueError(f"fp8_block_linear: x has last dimension {k}, weight has in_features {wk}")
    expect = (triton.cdiv(n, FP8_BLOCK), triton.cdiv(wk, FP8_BLOCK))
    if tuple(weight_scale_inv.shape) != expect or weight_scale_inv.dtype != torch.float32:
        raise ValueError(f"fp8_block_linear: weight_scale_inv must be float32 {expect} for weight "
                         f"{tuple(weight.shape)}, got {weight_scale_inv.dtype} "
                         f"{tuple(weight_scale_inv.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("fp8_block_linear: weight must be contiguous along K")


# (N, K, out dtype, device) of weights cuBLAS refused (a property of the library and the shape,
# process-wide): later calls go straight to the Triton kernel instead of raising again.
_CUBLAS_REFUSED: set = set()


def cublas_refused(n: int, k: int, out_dtype: torch.dtype, device) -> bool:
    """True once torch._scaled_mm refused an [N, K] weight for this output dtype and device."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return (n, k, out_dtype, d) in _CUBLAS_REFUSED


def cublas_scale_layout(weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """weight_scale_inv [nb, kb] as cuBLASLt's 128 x 128 block scaling reads it: row-major with a
    row pitch of round_up(kb, 4) (cuBLASLt pads each row of K blocks to a multiple of 4).

    torch 2.11's `_scaled_mm` checks for a pitch of exactly kb and passes the pointer through, so
    an unpadded matrix with kb % 4 != 0 was taken and read at shifted rows (every block row after
    the first got another row's scales: the tiny model's q_b_proj, N 256 K 128, had relative error
    0.71), while this padded layout is refused there for kb % 4 != 0 and the Triton kernel runs.
    A torch that checks the padded pitch takes it. Returns a [nb, kb] view of a padded buffer (no
    copy when `weight_scale_inv` is already laid out so); the Triton kernels read its strides.
    """
    nb, kb = weight_scale_inv.shape
    pitch = triton.cdiv(kb, 4) * 4
    if weight_scale_inv.stride(1) == 1 and (nb == 1 or weight_scale_inv.stride(0) == pitch):
        return weight_scale_inv
    padded = weight_scale_inv.new_zeros(nb, pitch)  # [nb, pitch]
    padded[:, :kb] = weight_scale_inv
    return padded[:, :kb]


def _cublas_block_linear(x2, x_scale, weight, weight_scale_inv, out_dtype):
    """y [M, N] through cuBLASLt's blockwise FP8 GEMM (1 x 128 x scales, 128 x 128 weight
    scales), or None where it cannot run (then remembered per shape, without a host sync).

    The activations are quantized with the scales column-major ([M, K/128], stride (1, M')) and
    the token count padded to CUBLAS_ROWS with zero rows, which only add discarded output rows.
    """
    key = (weight.shape[0], weight.shape[1], out_dtype, x2.device)
    if key in _CUBLAS_REFUSED:
        return None
    m = x2.shape[0]
    if x2.dtype == torch.float8_e4m3fn:
        if m % CUBLAS_ROWS:
            return None  # padding would copy x: the Triton kernel takes it as it is
        xq, xs = x2, (x_scale if x_scale.stride(0) == 1 else x_scale.t().contiguous().t())
    else:
        xq, xs = per_token_group_quant_fp8(x2, FP8_BLOCK, column_major_scales=True,
                                           rows_multiple=CUBLAS_ROWS)  # [M', K], [M', K/128]
    try:
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=cublas_scale_layout(weight_scale_inv).t(),
                             out_dtype=out_dtype)  # [M', N]
    except (RuntimeError, ValueError):  # shape, dtype or library version cuBLAS does not take
        _CUBLAS_REFUSED.add(key)
        return None
    return y[:m]


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, *,
                     x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                     weight_only: bool | None = None, fuse_quant: bool | None = None,
                     config: GemmConfig | None = None,
                     splitk_counters: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ (weight * weight_scale_inv)^T.

    x is bf16/fp16 (quantized here, per token and 128 channels), or float8_e4m3fn with its
    `x_scale` [M, ceil(K/128)]. The path is the config's (gemm_configs.fp8_config by default):
    "gemv_kblock" (M <= 2, fp8_gemv_kblock.py), "gemv" (M <= 4, fp8_gemv.py), "cublas" (blockwise
    torch._scaled_mm, the Triton kernel where cuBLAS refuses) or the Triton tiled kernel ("fused";
    "weight_only" is only a tiling hint). `weight_only` (default: the GPU has no FP8 tensor cores)
    keeps x in 16 bits on the tiled kernel whatever the config's path. `fuse_quant` quantizes x
    inside the Triton kernels (default: yes for M <= 64; on "gemv_kblock" where
    gemm_configs.kblock_fuses_quant says so). `splitk_counters` (int32, zero) may be passed to reuse one buffer across
    calls; it is left zero. `out` [M, N] receives y when given.
    """
    k = x.shape[-1]
    _check(weight, weight_scale_inv, k)
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    is_fp8 = x.dtype == torch.float8_e4m3fn
    if is_fp8 and (x_scale is None or tuple(x_scale.shape) != (m, triton.cdiv(k, FP8_BLOCK))):
        raise ValueError(f"fp8_block_linear: an fp8 x needs x_scale [{m}, {triton.cdiv(k, FP8_BLOCK)}]")
    out_dtype = out_dtype or (torch.bfloat16 if is_fp8 else x.dtype)
    if out is not None and (tuple(out.shape) != (m, n) or out.dtype != out_dtype
                            or out.stride(-1) != 1):
        raise ValueError(f"fp8_block_linear: out must be {out_dtype} [{m}, {n}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    if m == 0:
        out = out if out is not None else torch.empty(m, n, dtype=out_dtype, device=x.device)
        return out.reshape(*x.shape[:-1], n)
    cfg = config or fp8_config(m, n, k, x.device)
    if weight_only is None:  # W8A8 wherever the GPU has FP8 MMA (the checkpoint's dynamic scheme)
        weight_only = not has_fp8_mma(x.device)
    if weight_only and cfg.path in ("gemv", "gemv_kblock", "cublas"):
        cfg = fp8_tiled_config(m, n, k, x.device)
    if cfg.path == "cublas":
        y = _cublas_block_linear(x2, x_scale, weight, weight_scale_inv, out_dtype)
        if y is not None:
            out = y if out is None else out.copy_(y)
            return out.reshape(*x.shape[:-1], n)
        cfg = fp8_tiled_config(m, n, k, x.device)
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if cfg.path == "gemv_kblock":  # W8A8, x quantized in the kernel or once before (fp8_gemv_kblock.py); M <= 2
        fuse = fuse_quant if fuse_quant is not None else kblock_fuses_quant(m, n, k)
        a, a_s = (x2, x_scale) if is_fp8 or fuse else per_token_group_quant_fp8(x2, FP8_BLOCK)
        fp8_gemv_kblock(a, a_s, weight, weight_scale_inv, out, cfg.block_n, cfg.k_chunks, cfg.split_k,
                        cfg.num_warps, cfg.num_stages, splitk_counters)
        return out.reshape(*x.shape[:-1], n)
    if cfg.path == "gemv":
        if m > FP8_GEMV_MAX_M:
            raise ValueError(f"fp8_block_linear: config path 'gemv' serves M <= {FP8_GEMV_MAX_M} "
                             f"tokens, got M = {m}")
        a, a_s = (x2, x_scale) if is_fp8 or fuse_quant is not False else \
            per_token_group_quant_fp8(x2, FP8_BLOCK)
        fp8_gemv(a, a_s, weight, weight_scale_inv, out, cfg.block_n, cfg.split_k, cfg.num_warps,
                 cfg.num_stages, splitk_counters)
        return out.reshape(*x.shape[:-1], n)
    if is_fp8:
        a, a_s, mode = x2, x_scale, 0
    elif weight_only:
        a, a_s, mode = x2, weight_scale_inv, 2
    elif fuse_quant if fuse_quant is not None else m <= DECODE_MAX_M:
        a, a_s, mode = x2, weight_scale_inv, 1
    else:
        (a, a_s), mode = per_token_group_quant_fp8(x2, FP8_BLOCK), 0
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = min(cfg.split_k, triton.cdiv(k, FP8_BLOCK))
    part, counters = splitk_buffers(split, m, n, tiles, splitk_counters, x.device)
    _fp8_block_gemm_kernel[(tiles, split)](
        a, a_s, weight, weight_scale_inv, out, part, counters, m, n, k,
        a.stride(0), a_s.stride(0), a_s.stride(1), weight.stride(0), weight_scale_inv.stride(0),
        out.stride(0), split, A_MODE=mode, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
        SWIZZLE=8, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch(x.device))
    return out.reshape(*x.shape[:-1], n)


def fp8_block_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                               compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure torch, weight-only semantics (x unquantized): the CPU path of the runtime."""
    from dsquant.formats.fp8_block import dequantize_fp8_block

    w = dequantize_fp8_block(weight, weight_scale_inv, compute_dtype)  # [N, K]
    return (x.to(compute_dtype) @ w.t()).to(x.dtype)
