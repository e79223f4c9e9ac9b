"""INT4 and FP8 experts at decode on the tensor cores: one program per (pair, BLOCK_N channels, K split).

The per-pair GEMV (moe_gemv.py) turns each code into an fp32 FFMA, about 4.8 instructions a code in
its sm_90 loop, and at one token on the V2-Lite layer it runs at about a third of the roofline. The
grouped GEMM's INT4 main loop (moe_int4_loop.int4_mainloop) dequantizes two nibble planes per lop3
into packed bf16 and leaves the multiply-add to the tensor cores, with the weight as the register
operand (acc [BN, BM] = W a^T). Run on one block per pair (moe_gemm's PAIR_BLOCKS), it tied the GEMV
at one token: 176 programs (gate/up, BLOCK_N 128), each walking all of K. Here the same main loop
covers one split's run of 128-channel chunks, so the grid is (pairs, cdiv(N, BLOCK_N), split_k), and
the splits reduce through moe_gemv.pair_epilogue (fp32 partials [split_k, P, 2 or 1, N], one counter
per (pair, n-block), the last program sums in split order, then SiLU-and-mul or the routing weight).
Row 0 of the BLOCK_M-row tile is the pair's activation row; rows 1.. are masked (zero), so the
padding costs tensor-core work only.

Layouts as in moe_gemv.py: a [rows, K] bf16/fp16 with unit column stride (row pair // a_row_div);
qweight int32 [E, N/16, K/128, 16, 16] (moe_gemm's "int4"), scales [E, K/G, N] in a's dtype, zeros
uint8 [E, K/G, N], act-order perm int32 [E, K] or none (moe_int4_loop); out [P, N] (N/2 when gated)
in a's dtype; K % 128 == 0; G 32, 64 or 128. A pair
whose expert id is negative reads no weight and gets zeros, as in the GEMV.

FP8 (moe_pair_mma_fp8): the grouped GEMM's FP8 step (moe_gemm: e4m3 activation [BLOCK_M, 128] by
weight [128, BLOCK_N] tiles on the tensor cores, times the activation's per-token and the weight's
per-block scale) over one split's chunks, same grid and epilogue. At one token the grouped GEMM on
one block per pair runs 176 gate/up programs on the V2-Lite layer, 1.3 waves of 132 SMs; split-K
gives the tail more programs. Layouts: a float8_e4m3fn [rows, K] with a_scale fp32 [rows,
ceil(K/128)] (quantize_act_fp8), weight float8_e4m3fn [E, N, K], scale_inv fp32 [E, ceil(N/128),
ceil(K/128)]; gated N % 128 == 0 (MoeWeights checks it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.gemm.splitk import split_range
from dsquant.runtime.kernels.gemm.w4a16_mma import _MAGIC, paired_default
from dsquant.runtime.kernels.moe.moe_gemm import GroupedWeight, _load_weight_tile
from dsquant.runtime.kernels.moe.moe_gemv import check_pair_gemv, pair_epilogue, pair_launch
from dsquant.runtime.kernels.moe.moe_int4_loop import int4_mainloop

BLOCK_M = 16  # the dot's smallest token tile; one row of it is real


@triton.jit
def _pair_program(ids_ptr, a_row_div, N, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's pair, n-block and split, its expert (a negative id: clamped, with every mask off),
    channels offs_n [BN] and their mask, and the token tile's rows: row_mask [BM] (row 0 only) and
    their activation row a_row [BM] int64."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    here = expert >= 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = (offs_n < N) & here
    row_mask = (tl.arange(0, BLOCK_M) == 0) & here  # [BM]: row 0 is the pair
    a_row = tl.zeros([BLOCK_M], dtype=tl.int64) + (pair // a_row_div).to(tl.int64)
    return pair, pid_n, pid_k, tl.maximum(expert, 0), offs_n, n_mask, row_mask, a_row


@triton.jit
def _row0(acc, BLOCK_M: tl.constexpr):
    """acc [BN, BM] -> its column 0 [BN] (the pair's row of the transposed product)."""
    return tl.sum(tl.where(tl.arange(0, BLOCK_M)[None, :] == 0, acc, 0.0), axis=1)


@triton.jit(do_not_specialize=["split_k"])  # one compile for every split factor
def _moe_pair_mma_kernel(a_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, counters_ptr, topk_w_ptr, ids_ptr, perm_ptr,
                         N, K, a_row_div, stride_am, stride_we, stride_wc, stride_se, stride_s1, stride_s2,
                         stride_om, stride_pe, split_k, GROUP: tl.constexpr, GATED: tl.constexpr, ROUTED: tl.constexpr,
                         MAGIC: tl.constexpr, PAIRED: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_M: tl.constexpr, PDL: tl.constexpr = False, HAS_PERM: tl.constexpr = False):
    """Grid (P, cdiv(N, BLOCK_N), split_k); layouts in the module docstring."""
    pdl.enter(PDL)
    pair, pid_n, pid_k, expert, offs_n, n_mask, row_mask, a_row = _pair_program(ids_ptr, a_row_div, N, BLOCK_N,
                                                                                BLOCK_M)
    c_lo, c_hi = split_range(pid_k, K // 128, split_k)
    acc, acc_up = int4_mainloop(a_ptr, a_row, row_mask, stride_am, w_ptr, s_ptr, z_ptr, expert, offs_n, n_mask,
                                N, c_lo, c_hi, stride_we, stride_wc, stride_se, stride_s1, stride_s2, perm_ptr,
                                stride_pe, GATED, GROUP, MAGIC, PAIRED, a_ptr.dtype.element_ty, BLOCK_N, BLOCK_M,
                                HAS_PERM)  # [BN, BM] each
    y = _row0(acc, BLOCK_M)
    y_up = y
    if GATED:
        y_up = _row0(acc_up, BLOCK_M)
    pair_epilogue(y, y_up, out_ptr, part_ptr, counters_ptr, topk_w_ptr, pair, pid_n, pid_k, split_k,
                  offs_n, N, stride_om, GATED, ROUTED)


def moe_pair_mma_int4(a: torch.Tensor, w: GroupedWeight, topk_ids: torch.Tensor, out: torch.Tensor,
                      a_row_div: int, gated: bool, topk_weights: torch.Tensor | None = None,
                      block_n: int = 64, num_warps: int = 4, split_k: int | None = None,
                      num_stages: int = 2, _paired: bool | None = None) -> torch.Tensor:
    """out [P, N or N/2 when gated] for the P = topk_ids.numel() pairs (module docstring); the same
    arguments as moe_gemv.moe_gemv_int4. split_k None: moe_gemv.default_split_k; counters come from
    (and stay zero in) w.splitk_counters. _paired: the one-lop3 paired dequantization (None: on a
    GPU, not under TRITON_INTERPRET)."""
    pairs, n_out = check_pair_gemv("moe_pair_mma_int4", a, w, topk_ids, out, a_row_div, gated, "int4")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"moe_pair_mma_int4: block_n must be a power of two >= 16, got {block_n}")
    if a.dtype not in _MAGIC:
        raise ValueError(f"moe_pair_mma_int4: a must be bfloat16 or float16, got {a.dtype}")
    if pairs == 0:
        return out
    ids = topk_ids.reshape(-1)
    tw = topk_weights.reshape(-1).float() if topk_weights is not None else a
    grid, split, part, counters = pair_launch(w, pairs, n_out, block_n, split_k, gated, a.device)
    perm = w.perm if w.perm is not None else ids  # a stub pointer without act-order
    _moe_pair_mma_kernel[grid](a, w.weight, w.scales, w.zeros, out, part, counters, tw, ids, perm, n_out, w.k,
                               a_row_div, a.stride(0), w.weight.stride(0), w.weight.stride(1),
                               w.scales.stride(0), w.scales.stride(1), w.scales.stride(2), out.stride(0),
                               perm.stride(0), split, GROUP=w.group_size, GATED=gated, HAS_PERM=w.perm is not None,
                               ROUTED=topk_weights is not None,
                               MAGIC=_MAGIC[a.dtype], PAIRED=paired_default() if _paired is None else _paired,
                               BLOCK_N=block_n, BLOCK_M=BLOCK_M, num_warps=num_warps, num_stages=num_stages,
                               **pdl.launch(a.device))
    return out


@triton.jit
def _fp8_chunk(acc, a, a_s, w_ptr, s_ptr, expert, offs_n, n_mask, c, K, stride_we, stride_wn, stride_se,
               stride_s1, stride_s2, FP8_UPCAST: tl.constexpr):
    """acc [BM, BN] += chunk c: a [BM, 128] e4m3 (scales a_s [BM]) by W_e[offs_n, 128c:128c+128]^T."""
    b = _load_weight_tile(w_ptr, expert, offs_n, n_mask, c * 128, K, stride_we, stride_wn, 128)  # [128, BN]
    w_s = tl.load(s_ptr + expert * stride_se + c * stride_s2 + (offs_n // 128) * stride_s1, mask=n_mask, other=0.0)
    if FP8_UPCAST:  # the Triton interpreter has no fp8 dot: the same products in fp32
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return acc + tl.dot(a, b) * a_s[:, None] * w_s[None, :]


@triton.jit(do_not_specialize=["split_k"])
def _moe_pair_fp8_kernel(a_ptr, as_ptr, w_ptr, s_ptr, out_ptr, part_ptr, counters_ptr, topk_w_ptr, ids_ptr,
                         N, K, a_row_div, stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_s1,
                         stride_s2, stride_om, split_k, GATED: tl.constexpr, ROUTED: tl.constexpr,
                         FP8_UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Grid (P, cdiv(N, BLOCK_N), split_k); layouts in the module docstring (FP8)."""
    pdl.enter(PDL)
    pair, pid_n, pid_k, expert, offs_n, n_mask, row_mask, a_row = _pair_program(ids_ptr, a_row_div, N, BLOCK_N,
                                                                                BLOCK_M)
    c_lo, c_hi = split_range(pid_k, tl.cdiv(K, 128), split_k)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for c in range(c_lo, c_hi):
        offs_k = c * 128 + tl.arange(0, 128)
        a = tl.load(a_ptr + a_row[:, None] * stride_am + offs_k[None, :],
                    mask=row_mask[:, None] & (offs_k[None, :] < K), other=0.0)  # [BM, 128] e4m3
        a_s = tl.load(as_ptr + a_row * stride_asm + c, mask=row_mask, other=0.0)  # [BM]
        acc = _fp8_chunk(acc, a, a_s, w_ptr, s_ptr, expert, offs_n, n_mask, c, K, stride_we, stride_wn,
                         stride_se, stride_s1, stride_s2, FP8_UPCAST)
        if GATED:
            acc_up = _fp8_chunk(acc_up, a, a_s, w_ptr, s_ptr, expert, offs_n + N, n_mask, c, K, stride_we,
                                stride_wn, stride_se, stride_s1, stride_s2, FP8_UPCAST)
    y = _row0(tl.trans(acc), BLOCK_M)  # [BN]: row 0, the pair's
    y_up = y
    if GATED:
        y_up = _row0(tl.trans(acc_up), BLOCK_M)
    pair_epilogue(y, y_up, out_ptr, part_ptr, counters_ptr, topk_w_ptr, pair, pid_n, pid_k, split_k,
                  offs_n, N, stride_om, GATED, ROUTED)


def moe_pair_mma_fp8(a: torch.Tensor, a_scale: torch.Tensor, w: GroupedWeight, topk_ids: torch.Tensor,
                     out: torch.Tensor, a_row_div: int, gated: bool, topk_weights: torch.Tensor | None = None,
                     block_n: int = 64, num_warps: int = 4, split_k: int | None = None, num_stages: int = 3,
                     block_m: int = BLOCK_M, fp8_upcast: bool = False) -> torch.Tensor:
    """out [P, N or N/2 when gated] (bf16/fp16) for the P = topk_ids.numel() pairs of FP8 experts; a
    e4m3 [rows, K] with a_scale fp32 [rows, ceil(K/128)] (module docstring). block_m: the token tile,
    one row of it real; 16 compiles (Triton 3.8, sm_90) to fp16 MMAs on codes converted in registers,
    64 to e4m3 wgmma (QGMMA) on the codes as loaded. fp8_upcast: the dots in fp32 (the Triton
    interpreter has no fp8 dot)."""
    pairs, n_out = check_pair_gemv("moe_pair_mma_fp8", a, w, topk_ids, out, a_row_div, gated, "fp8")
    if block_n < 16 or block_n & (block_n - 1) or block_m not in (16, 64):
        raise ValueError(f"moe_pair_mma_fp8: block_n must be a power of two >= 16 and block_m 16 or 64, "
                         f"got {block_n} and {block_m}")
    chunks = triton.cdiv(w.k, 128)
    if (a.dtype != torch.float8_e4m3fn or a_scale.dtype != torch.float32 or tuple(a_scale.shape) != (a.shape[0], chunks)
            or a_scale.stride(1) != 1):
        raise ValueError(f"moe_pair_mma_fp8: a must be float8_e4m3fn with a_scale fp32 [{a.shape[0]}, {chunks}] "
                         f"(unit column stride), got {a.dtype} and {a_scale.dtype} {tuple(a_scale.shape)}")
    if pairs == 0:
        return out
    ids = topk_ids.reshape(-1)
    tw = topk_weights.reshape(-1).float() if topk_weights is not None else a_scale
    grid, split, part, counters = pair_launch(w, pairs, n_out, block_n, split_k, gated, a.device)
    _moe_pair_fp8_kernel[grid](a, a_scale, w.weight, w.scales, out, part, counters, tw, ids, n_out, w.k,
                               a_row_div, a.stride(0), a_scale.stride(0), w.weight.stride(0), w.weight.stride(1),
                               w.scales.stride(0), w.scales.stride(1), w.scales.stride(2), out.stride(0), split,
                               GATED=gated, ROUTED=topk_weights is not None, FP8_UPCAST=fp8_upcast,
                               BLOCK_N=block_n, BLOCK_M=block_m, num_warps=num_warps, num_stages=num_stages,
                               **pdl.launch(a.device))
    return out
