"""Grouped GEMM over all experts of a MoE layer, one launch for every expert's rows.

Rows come grouped by expert from moe_align (sorted_token_ids, expert_ids: one expert per
BLOCK_M-row block). For the pair p = t * top_k + j in a block of expert e:
    out[p, n] = sum_k a[p // a_row_div, k] * W_e[n, k]
a_row_div = top_k when a is the hidden states [T, K] (gate/up projection) and 1 when a holds one
row per pair [T*top_k, K] (down projection). Epilogues:
- gated (w13 stacked gate rows [0, N) then up rows [N, 2N)): out[p, n] = silu(gate) * up (gate, up
  and silu rounded to out's dtype as the reference MLP rounds them),
  the SiLU-and-mul fused, out [T*top_k, N];
- routed: out[p, n] *= topk_weights[p] (fp32 [T*top_k]), out [T*top_k, N].
Expert weight layouts (GroupedWeight.format), N output rows, K input columns, all experts stacked:
- "bf16": weight [E, N, K] in the activation dtype (bf16 or fp16).
- "int4": qweight int32 [E, N/16, K/128, 16, 16] (tiled, repacked from AWQ by fused_moe_int4:
  word i of row r in chunk c, tile t holds, in nibble j, W[16c + r, 128t + 16j + i]), scales
  [E, K/G, N] in the activation dtype, zeros uint8 [E, K/G, N]; W[n, k] = (q - z) * s,
  dequantised in registers two nibble planes per instruction (moe_int4_loop.py); BLOCK_K = 128.
  Act-order GPTQ experts add perm int32 [E, K]: packed channel k of expert e multiplies
  a[row, perm[e, k]] (the activation slices are gathered through it).
- "fp8": weight float8_e4m3fn [E, N, K], scale_inv fp32 [E, ceil(N/128), ceil(K/128)]; a is fp8
  [rows, K] with a_scale fp32 [rows, ceil(K/128)] (per token per 128 channels), or a bf16/fp16
  a (a_scale None, A_QUANT) that each program quantizes per [BLOCK_M, 128] tile with
  fp8_quant.quant_group_fp8 (quantize_act_fp8's arithmetic; GPU only: the Triton interpreter
  mis-rounds in-kernel fp8 casts); BLOCK_K = 128.
Accumulation is fp32; outputs are rounded once to out's dtype.
Blocks come from moe_align (sorted ids) or, with moe_align.one_block_per_pair (PAIR_BLOCKS), block
b is pair b alone (its other BLOCK_M - 1 rows masked) and its expert topk_ids.flat[b]: no align
launch, which is what one decode token wants.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.gemm.fp8_quant import quant_group_fp8
from dsquant.runtime.kernels.ops.activation import silu_mul_as_reference
from dsquant.runtime.kernels.gemm.w4a16_mma import _MAGIC, paired_default
from dsquant.runtime.kernels.moe.moe_align import MoeAlignment
from dsquant.runtime.kernels.moe.moe_int4_loop import int4_mainloop

FORMATS = {"bf16": 0, "int4": 1, "fp8": 2}


@dataclass
class GroupedWeight:
    """One projection of every expert (see the module docstring for each format's layout)."""
    format: str
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    group_size: int = 0
    n: int = 0  # output rows per expert (2I for a stacked w13)
    k: int = 0  # input columns
    splitk_counters: torch.Tensor | None = None  # int32, zero: split-K counters of the per-pair GEMVs
    perm: torch.Tensor | None = None  # "int4" under act-order: int32 [E, K], packed channel j meets a[:, perm[e, j]]

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _load_weight_tile(w_ptr, expert, offs_n, n_mask, k0, K, stride_we, stride_wn, BLOCK_K: tl.constexpr):
    """bf16 / fp8 W_e[offs_n, k0:k0+BLOCK_K]^T as a [BLOCK_K, BLOCK_N] tile."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    return tl.load(ptrs, mask=n_mask[None, :] & (offs_k[:, None] < K), other=0.0)


@triton.jit
def _moe_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, s_ptr, z_ptr, out_ptr, topk_w_ptr,
                     sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr, perm_ptr,
                     N, K, num_pairs, a_row_div,
                     stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_s1, stride_s2,
                     stride_om, stride_pe,
                     W_FORMAT: tl.constexpr, GROUP: tl.constexpr, GATED: tl.constexpr,
                     ROUTED: tl.constexpr, FP8_UPCAST: tl.constexpr, MAGIC: tl.constexpr, PAIRED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PAIR_BLOCKS: tl.constexpr = False, A_QUANT: tl.constexpr = False, PDL: tl.constexpr = False,
                     HAS_PERM: tl.constexpr = False):
    """Grid (blocks, cdiv(N, BLOCK_N)); layouts in the module docstring. PAIR_BLOCKS: block pid_m is
    pair pid_m (sorted_ids_ptr, num_post_pad_ptr unused); A_QUANT: fp8 weights, a bf16/fp16
    quantized here per [BLOCK_M, 128] tile (a_scale_ptr unused); HAS_PERM: int4 act-order experts
    (perm_ptr [E, K], row stride stride_pe)."""
    pdl.enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if PAIR_BLOCKS:
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)  # [BLOCK_M]: the pair, then padding
    else:
        if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
            return
        pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # PAIR_BLOCKS: a pair whose expert is on another rank (fused_moe's negative ids)
        return
    row_mask = pair < num_pairs
    a_row = (pair // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = offs_n < N
    DTYPE = a_ptr.dtype.element_ty  # int4 tiles are dequantised to the activation dtype
    if W_FORMAT == 1:  # transposed accumulators [BN, BM], see moe_int4_loop
        acc, acc_up = int4_mainloop(a_ptr, a_row, row_mask, stride_am, w_ptr, s_ptr, z_ptr, expert, offs_n,
                                    n_mask, N, 0, K // 128, stride_we, stride_wn, stride_se, stride_s1, stride_s2,
                                    perm_ptr, stride_pe, GATED, GROUP, MAGIC, PAIRED, DTYPE, BLOCK_N, BLOCK_M,
                                    HAS_PERM)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + a_row[:, None] * stride_am + offs_k[None, :],
                        mask=row_mask[:, None] & (offs_k[None, :] < K), other=0.0)  # [BM, BLOCK_K]
            b = _load_weight_tile(w_ptr, expert, offs_n, n_mask, k0, K, stride_we, stride_wn, BLOCK_K)
            if GATED:
                b_up = _load_weight_tile(w_ptr, expert, offs_n + N, n_mask, k0, K, stride_we, stride_wn,
                                         BLOCK_K)
            if W_FORMAT == 2:
                if A_QUANT:  # per row of the tile: scale = max(amax, 1e-10) / 448, e4m3 codes
                    a, a_s = quant_group_fp8(a.to(tl.float32), 1)  # [BM, BLOCK_K] e4m3, [BM]
                else:
                    a_s = tl.load(a_scale_ptr + a_row * stride_asm + k0 // 128, mask=row_mask, other=0.0)
                w_off = expert * stride_se + (k0 // 128) * stride_s2  # scale_inv [E, N/128, K/128]
                w_s = tl.load(s_ptr + w_off + (offs_n // 128) * stride_s1, mask=n_mask, other=0.0)
                if FP8_UPCAST:  # the Triton interpreter has no fp8 dot: same products in fp32
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc += tl.dot(a, b) * a_s[:, None] * w_s[None, :]
                if GATED:
                    w_s_up = tl.load(s_ptr + w_off + ((offs_n + N) // 128) * stride_s1, mask=n_mask, other=0.0)
                    if FP8_UPCAST:
                        b_up = b_up.to(tl.float32)
                    acc_up += tl.dot(a, b_up) * a_s[:, None] * w_s_up[None, :]
            else:
                acc = tl.dot(a, b, acc)
                if GATED:
                    acc_up = tl.dot(a, b_up, acc_up)
    if W_FORMAT == 1:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    if GATED:
        acc = silu_mul_as_reference(acc, acc_up, out_ptr.dtype.element_ty)
    if ROUTED:
        acc = acc * tl.load(topk_w_ptr + pair, mask=row_mask, other=0.0)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def moe_gemm(a: torch.Tensor, w: GroupedWeight, align: MoeAlignment, out: torch.Tensor,
             cfg: GemmConfig, a_row_div: int, gated: bool, topk_weights: torch.Tensor | None = None,
             a_scale: torch.Tensor | None = None, fp8_upcast: bool = False) -> torch.Tensor:
    """One grouped GEMM (see module docstring). out [T*top_k, N or N/2 when gated] is written.
    fp8 experts take a float8_e4m3fn a with a_scale, or a bf16/fp16 a (a_scale None) quantized in
    the kernel (GPU only)."""
    if cfg.block_m != align.block_m:
        raise ValueError(f"config block_m {cfg.block_m} differs from the alignment's {align.block_m}")
    n_out = w.n // 2 if gated else w.n
    if a.shape[1] != w.k or out.shape[1] != n_out or a.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"moe_gemm shapes: a {tuple(a.shape)}, weight n={w.n} k={w.k}, out {tuple(out.shape)}")
    fmt = FORMATS[w.format]
    if fmt == 1 and (cfg.block_k != 128 or cfg.block_n % 16):
        raise ValueError(f"int4 experts need BLOCK_K = 128 (the packing tile) and BLOCK_N a multiple of 16, "
                         f"got {cfg.block_k} and {cfg.block_n}")
    a_quant = fmt == 2 and a_scale is None
    if fmt == 2 and cfg.block_k != 128:
        raise ValueError(f"fp8 experts need BLOCK_K = 128 (the scale block), got {cfg.block_k}")
    if fmt == 2 and (a.dtype == torch.float8_e4m3fn) == a_quant:
        raise ValueError(f"fp8 experts take a float8_e4m3fn a with a_scale, or a bf16/fp16 a without "
                         f"(quantized in the kernel); got {a.dtype} with a_scale "
                         f"{'None' if a_scale is None else tuple(a_scale.shape)}")
    s = w.scales if w.scales is not None else w.weight
    z = w.zeros if w.zeros is not None else w.weight
    a_s = a_scale if a_scale is not None else a
    tw = topk_weights.reshape(-1) if topk_weights is not None else a
    s_strides = (s.stride(0), s.stride(1), s.stride(2)) if s.dim() == 3 else (0, 0, 0)
    grid = (align.expert_ids.shape[0], triton.cdiv(n_out, cfg.block_n))
    pair_blocks = align.one_block_per_pair
    sorted_ids = align.expert_ids if pair_blocks else align.sorted_token_ids  # a stub pointer for pair blocks
    num_post = align.expert_ids if pair_blocks else align.num_tokens_post_padded
    perm = w.perm if w.perm is not None else align.expert_ids  # a stub pointer without act-order
    _moe_gemm_kernel[grid](
        a, a_s, w.weight, s, z, out, tw, sorted_ids, align.expert_ids,
        num_post, perm, n_out, w.k, align.num_pairs, a_row_div,
        a.stride(0), a_s.stride(0), w.weight.stride(0), w.weight.stride(1), *s_strides, out.stride(0), perm.stride(0),
        W_FORMAT=fmt, GROUP=max(w.group_size, 1), GATED=gated, HAS_PERM=w.perm is not None,
        ROUTED=topk_weights is not None, FP8_UPCAST=fp8_upcast, MAGIC=_MAGIC.get(a.dtype, 0),
        PAIRED=paired_default(), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PAIR_BLOCKS=pair_blocks, A_QUANT=a_quant,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch(out.device))
    return out
