"""W4A16 dequant-GEMM: y = x @ W^T with W held as 4-bit codes, per-group scales and zero points.

Layouts (see w4a16_repack.py): x [M, K] bf16/fp16 (row stride free, unit column stride);
qweight int32 [N, K/8] packed along K; scales [K/G, N]; zeros uint8 [K/G, N]; perm int32 [K]
(optional, GPTQ act-order); y [M, N] in x's dtype. K % G == 0, G % 16 == 0.

The kernel computes the transposed tile acc[n, m] = sum_k W[n, k] x[m, k], so the weight tile
(BLOCK_N >= 64 rows) is the MMA's wide operand and a decode batch of 1..64 tokens only pads the
narrow side to 16. Codes are never converted integer-to-float: OR-ing a code into the exponent
pattern of 128.0 (bf16 0x4300) or 1024.0 (fp16 0x6400) gives the exact value OFFSET + q in one
bit operation. Zero point and scale are applied once per group and output, outside the dot:
    sum_{k in g} (q - z) s x = s * (dot(OFFSET + q, x) - (OFFSET + z) * sum_{k in g} x)
with the dot accumulated in fp32, so the per-element dequant cost is a shift, a mask and an OR.

This kernel reads the plain code order (shapes where K % 128 != 0 or G > 128); weights in the
paired order (W4A16Weights.sliced) take w4a16_mma.py's kernel instead, for every M below the
dequantize path except the decode sizes where the paired-order GEMVs win (gemm_configs.w4a16_config).
Paths for plain-order weights, chosen by M through gemm_configs.w4a16_config: M <= 2, the GEMV of w4a16_gemv.py (no
tensor cores); decode (M <= 64) tiles of 16..64 tokens
with split-K over groups (splitk.store_tile) to cover every multiprocessor; prefill tiles of
64..128 tokens; and for large M "dequant": dequantize W to [N, K] once and call cuBLAS.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels.gemm.gemm_configs import GemmConfig, w4a16_config
from dsquant.runtime.kernels.gemm.splitk import split_range, splitk_buffers, store_tile, swizzled_tile
from dsquant.runtime.kernels.gemm.w4a16_gemv import w4a16_gemv
from dsquant.runtime.kernels.gemm.w4a16_gemv_kblock import w4a16_gemv_kblock
from dsquant.runtime.kernels.gemm.w4a16_mma import w4a16_mma
from dsquant.runtime.kernels.gemm.w4a16_repack import W4A16Weights

_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


@triton.jit
def _unpack_nibbles(qw, ROWS: tl.constexpr, COLS: tl.constexpr):
    """int32 [ROWS, COLS/8] -> codes [ROWS, COLS]; column 8c + i = nibble i of word c.

    Built from in-thread joins, so each thread expands whole words it holds: the broadcast form
    (qw[:, :, None] >> shifts) spread one word over 8 threads and cost about 4x the shared-memory
    instructions on sm_90 (SASS of the 64 x 128 tile: 84 LDS + 76 STS against 22 + 20).
    join(a, b) adds a minor axis of 2; three levels give index 4*i0 + 2*i1 + i2 = nibble.
    """
    n0 = qw & 0xF
    n1 = (qw >> 4) & 0xF
    n2 = (qw >> 8) & 0xF
    n3 = (qw >> 12) & 0xF
    n4 = (qw >> 16) & 0xF
    n5 = (qw >> 20) & 0xF
    n6 = (qw >> 24) & 0xF
    n7 = (qw >> 28) & 0xF
    q = tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)), tl.join(tl.join(n1, n5), tl.join(n3, n7)))
    return tl.reshape(q, (ROWS, COLS))  # [ROWS, COLS/8, 2, 2, 2] -> [ROWS, COLS]


@triton.jit(do_not_specialize=["M", "split_k"])  # one compile for any M and split
def _w4a16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, part_ptr, counters_ptr,
                       M, N, num_groups, stride_xm, stride_qn, stride_sg, stride_zg, stride_om,
                       split_k,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                       HAS_PERM: tl.constexpr, MAGIC: tl.constexpr,
                       OFFSET: tl.constexpr, SWIZZLE: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n, pid_m = swizzled_tile(pid, M, N, BLOCK_M, BLOCK_N, SWIZZLE)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_w = tl.arange(0, GROUP // 8)  # [G/8] packed words of one group
    offs_k = tl.arange(0, GROUP)  # [G]
    dtype = x_ptr.dtype.element_ty

    g_lo, g_hi = split_range(pid_k, num_groups, split_k)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for g in range(g_lo, g_hi):
        qw = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (g * (GROUP // 8) + offs_w)[None, :],
                     mask=n_mask[:, None], other=0)  # [BN, G/8] int32
        k_idx = g * GROUP + offs_k  # [G]
        if HAS_PERM:
            k_idx = tl.load(perm_ptr + k_idx)
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + k_idx[:, None],
                     mask=m_mask[None, :], other=0.0)  # [G, BM]
        q = _unpack_nibbles(qw, BLOCK_N, GROUP)  # [BN, G], column 8c + i = nibble i of word c
        w = (q | MAGIC).to(tl.int16).to(dtype, bitcast=True)  # [BN, G] = OFFSET + q exactly
        d = tl.dot(w, xt)  # [BN, BM] fp32
        x_sum = tl.sum(xt.to(tl.float32), axis=0)  # [BM]
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
        z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_mask, other=0).to(tl.float32) + OFFSET
        acc += s[:, None] * (d - z[:, None] * x_sum[None, :])
    store_tile(acc, out_ptr, part_ptr, counters_ptr, offs_n, offs_m, M, N, stride_om,
               pid, pid_k, split_k)


@triton.jit
def _w4a16_dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, stride_qn, stride_sg, stride_zg,
                          stride_wn, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes W [N, K] (kernel K order) for the dequantize + cuBLAS path; one group per program."""
    pid_n = tl.program_id(0)
    g = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    offs_w = tl.arange(0, GROUP // 8)
    qw = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (g * (GROUP // 8) + offs_w)[None, :],
                 mask=n_mask[:, None], other=0)  # [BN, G/8]
    q = (qw[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
    q = tl.reshape(q, (BLOCK_N, GROUP)).to(tl.float32)  # [BN, G]
    s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_mask, other=0).to(tl.float32)
    w = (q - z[:, None]) * s[:, None]
    offs_k = g * GROUP + tl.arange(0, GROUP)
    tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], w.to(w_ptr.dtype.element_ty),
             mask=n_mask[:, None])


@triton.jit
def _w4a16_dequant_sliced_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, stride_qn, stride_sg, stride_zg,
                                 stride_wn, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """The same over the paired code order (int4_paired.py); one 128-wide chunk per program, its
    nibble planes j and j + 4 written together as 32 consecutive channels."""
    pid_n = tl.program_id(0)
    c = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    offs_w = tl.arange(0, 16)
    qw = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (c * 16 + offs_w)[None, :],
                 mask=n_mask[:, None], other=0)  # [BN, 16]
    for j in tl.static_range(4):
        g = (c * 128 + 32 * j) // GROUP
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_mask, other=0).to(tl.float32)
        q_even = ((qw >> (4 * j)) & 0xF).to(tl.float32)  # [BN, 16]: channels c * 128 + 32j + 2w
        q_odd = ((qw >> (4 * j + 16)) & 0xF).to(tl.float32)  # 32j + 2w + 1
        q = tl.reshape(tl.join(q_even, q_odd), (BLOCK_N, 32))
        offs_k = c * 128 + 32 * j + tl.arange(0, 32)
        tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                 ((q - z[:, None]) * s[:, None]).to(w_ptr.dtype.element_ty), mask=n_mask[:, None])


def w4a16_dequantize(w: W4A16Weights, dtype: torch.dtype) -> torch.Tensor:
    """Triton dequantize: kernel layout -> dense [N, K] in `dtype` (kernel K order)."""
    n, k = w.out_features, w.in_features
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    block_n = 64
    kernel = _w4a16_dequant_sliced_kernel if w.sliced else _w4a16_dequant_kernel
    grid = (triton.cdiv(n, block_n), k // 128 if w.sliced else k // w.group_size)
    kernel[grid](w.qweight, w.scales, w.zeros, out, n, w.qweight.stride(0), w.scales.stride(0),
                 w.zeros.stride(0), out.stride(0), GROUP=w.group_size, BLOCK_N=block_n)
    return out


def _output(out, m, n, dtype, device) -> torch.Tensor:
    if out is None:
        return torch.empty(m, n, dtype=dtype, device=device)
    if tuple(out.shape) != (m, n) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {dtype} [{m}, {n}] with unit column stride, got {out.dtype} "
                         f"{tuple(out.shape)}")
    return out


def _check_inputs(x: torch.Tensor, w: W4A16Weights) -> None:
    if x.dtype not in _MAGIC:
        raise ValueError(f"w4a16_linear: x must be bfloat16 or float16, got {x.dtype}")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"w4a16_linear: x has last dimension {x.shape[-1]}, expected in_features "
                         f"{w.in_features}")
    g = w.group_size
    if g < 16 or g & (g - 1) or w.in_features % g:
        raise ValueError(f"w4a16_linear: group_size {g} must be a power of two >= 16 dividing "
                         f"in_features {w.in_features}")
    if x.device != w.qweight.device:
        raise ValueError(f"w4a16_linear: x is on {x.device} but qweight is on {w.qweight.device}")


def w4a16_linear(x: torch.Tensor, w: W4A16Weights, config: GemmConfig | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(W)^T, in x's dtype; written into `out` [M, N] if given."""
    _check_inputs(x, w)
    n, k = w.out_features, w.in_features
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    cfg = config or w4a16_config(m, n, k, w.group_size, x.device, sliced=w.sliced)
    if cfg.path == "dequant":
        x_in = x2[:, w.perm.long()] if w.perm is not None else x2
        y = torch.nn.functional.linear(x_in, w4a16_dequantize(w, x.dtype))
        if out is not None:
            out.copy_(y)
            y = out
        return y.reshape(*x.shape[:-1], n)
    out = _output(out, m, n, x.dtype, x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    if cfg.path == "gemv":
        w4a16_gemv(x2, w, out, cfg.block_n, cfg.split_k, cfg.num_warps, cfg.num_stages)
        return out.reshape(*x.shape[:-1], n)
    if cfg.path == "gemv_kblock":
        w4a16_gemv_kblock(x2, w, out, cfg.block_n, cfg.k_chunks, cfg.split_k, cfg.num_warps, cfg.num_stages)
        return out.reshape(*x.shape[:-1], n)
    if w.sliced:
        w4a16_mma(x2, w.qweight, w.scales, w.zeros, w.group_size, out, cfg.block_n, cfg.block_m,
                  cfg.split_k, cfg.num_warps, cfg.num_stages, perm=w.perm, counters=w.splitk_counters)
        return out.reshape(*x.shape[:-1], n)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = min(cfg.split_k, k // w.group_size)
    part, counters = splitk_buffers(split, m, n, tiles, w.splitk_counters, x.device)
    magic, offset = _MAGIC[x.dtype]
    perm = w.perm if w.perm is not None else w.qweight
    _w4a16_gemm_kernel[(tiles, split)](
        x2, w.qweight, w.scales, w.zeros, perm, out, part, counters,
        m, n, k // w.group_size, x2.stride(0), w.qweight.stride(0), w.scales.stride(0),
        w.zeros.stride(0), out.stride(0), split,
        GROUP=w.group_size, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
        HAS_PERM=w.perm is not None, MAGIC=magic, OFFSET=offset, SWIZZLE=8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.reshape(*x.shape[:-1], n)
