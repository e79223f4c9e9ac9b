"""Fused MoE experts: align pairs by expert, gate/up GEMM with SiLU-and-mul, down GEMM, then the
weighted top-k sum with shared experts and the residual in one moe_sum launch.

    hidden [T, H], topk_weights fp32 [T, P], topk_ids [T, P]  ->  out [T, H]
    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]
             (+ shared experts) (+ residual[t])
Weights (MoeWeights): w13 = gate rows [0, I) then up rows [I, 2I) of each expert, n = 2I, k = H;
w2 n = H, k = I; both GroupedWeight of one format ("bf16", "int4", "fp8"; see moe_gemm).
The down GEMM writes each pair's unweighted output rounded to the activation dtype (as the reference
expert MLP rounds it); moe_sum weights and sums them in fp32 (see its rounding order).
Shared experts, either way:
- pass shared_output [T, H] (computed by the caller's dense MLP) and moe_sum adds it; or
- run them inside the grouped GEMMs as extra always-selected experts: stack them after the routed
  experts (split_shared_experts cuts an MLP of intermediate n*I into n experts of width I, exact
  because SiLU-and-mul is elementwise), append them to the routing (with_shared_experts, or
  moe_route's n_shared) and pass n_shared: the last n_shared of the P columns.
Block sizes are picked by a heuristic from the pairs per expert (never tuned at run time).
INT4 experts with at most MOE_GEMV_MAX_PAIRS (token, expert) pairs (decode) skip the alignment and
run moe_gemv's per-pair GEMVs (split-K by moe_gemv.default_split_k, counters reserved here at load)
instead of the grouped MMA GEMMs. FP8 experts always take the grouped GEMMs (see _expert_gemvs).
With MOE_PAIR_MMA (on; DSQUANT_MOE_PAIR_MMA=0 turns it off) 16-bit activations' pairs run on the
tensor cores with split-K instead (moe_pair_mma.py), at PAIR_MMA_CONFIGS: 27-29% faster per projection.
Up to ONE_BLOCK_PER_PAIR_MAX_TOKENS tokens on the grouped GEMMs run one block per pair, without the
align launch (moe_align.one_block_per_pair); up to FP8_FUSE_QUANT_MAX_TOKENS, fp8 experts quantize
the activations inside the GEMMs (off: it lost on the GPU, see below).
INT4 experts with prefill-sized batches (DEQUANT_MIN_PAIRS_PER_EXPERT) are dequantized once per call
and run the bf16 grouped GEMMs (int4_dequant.py says why).
A pair with a negative expert id and weight 0 is not here (expert parallelism: the expert is on another
rank, parallel/moe.py): on every path it reads no weight (moe_align drops it, the GEMVs mask it, a pair
block of it returns), its piece is left unwritten or zero, and moe_sum does not read weight-0 pieces.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dsquant.runtime.kernels.moe.fused_moe_fp8 import quantize_act_fp8
from dsquant.runtime.kernels.moe.int4_dequant import dequantize_int4_grouped
from dsquant.runtime.kernels.moe.moe_align import moe_align_block_size, one_block_per_pair
from dsquant.runtime.kernels.moe.moe_gemm import GemmConfig, GroupedWeight, moe_gemm
from dsquant.runtime.kernels.moe.moe_gemv import MOE_GEMV_MAX_PAIRS, moe_gemv_int4, reserve_gemv_counters
from dsquant.runtime.kernels.moe.moe_pair_mma import moe_pair_mma_fp8, moe_pair_mma_int4
from dsquant.runtime.kernels.moe.moe_sum import MoESumInputs, moe_sum

# INT4 experts with at least this many (token, expert) pairs per expert (a prefill chunk) are
# dequantized to the activation dtype once per call (int4_dequant.py) and run the bf16 grouped GEMM,
# when w13 + w2 dequantized take at most DEQUANT_MAX_BYTES.
DEQUANT_MIN_PAIRS_PER_EXPERT = 256
DEQUANT_MAX_BYTES = 4 << 30
# Batches of at most this many tokens on the grouped GEMMs skip moe_align (one block per pair; a
# token's experts are distinct, so no weight is read twice). H100, V2-Lite layer, 8 layers' weights,
# graph replays (gpu.sh moeq: scripts/moe_decode_probe.py, 2026-12-06): fp8 T = 1 36.6 vs 40.4 us,
# T = 2 53.3 vs 57.5; bf16 T = 1 53.6 vs 57.4, T = 2 86.6 vs 91.5; at T = 8 bf16 loses (221.0 vs 218.6)
# and at T = 64 both lose 2.6x (each pair's block reads its expert's weights again).
ONE_BLOCK_PER_PAIR_MAX_TOKENS = 2
# fp8 experts quantize the activations inside the grouped GEMMs (A_QUANT) up to this many tokens:
# off. On the H100 it lost everywhere (2026-12-06): T = 1 103.5 vs 36.6 us, T = 8 287.8 vs 133.8,
# T = 64 467.0 vs 245.5, and the FP8 engine at batch 1 ran 245 vs 409 tok/s (an earlier try); probably the
# per-step tile amax in the K loop costs more than the two quant launches it saves. Kept (CPU- and
# GPU-tested) for a faster form.
FP8_FUSE_QUANT_MAX_TOKENS = 0


@dataclass
class MoeWeights:
    w13: GroupedWeight  # n = 2I, k = H
    w2: GroupedWeight  # n = H, k = I

    def __post_init__(self):
        if self.w13.format != self.w2.format:
            raise ValueError(f"w13 is {self.w13.format} but w2 is {self.w2.format}")
        inter = self.w13.n // 2
        if self.w13.n % 2 or self.w2.k != inter or self.w2.n != self.w13.k:
            raise ValueError(f"expert shapes disagree: w13 n={self.w13.n} k={self.w13.k}, "
                             f"w2 n={self.w2.n} k={self.w2.k} (expected w2 = [H, I], w13 = [2I, H])")
        if self.w13.num_experts != self.w2.num_experts:
            raise ValueError(f"w13 has {self.w13.num_experts} experts, w2 {self.w2.num_experts}")
        if self.w13.format == "fp8" and inter % 128:
            raise ValueError(f"fp8 experts need moe_intermediate_size % 128 == 0, got {inter}")
        if self.w13.format in ("int4", "fp8"):  # the decode GEMVs' (pair MMAs') split-K counters
            reserve_gemv_counters(self.w13, inter)
            reserve_gemv_counters(self.w2, self.w2.n)

    @property
    def num_experts(self) -> int:
        return self.w13.num_experts


def bf16_experts(weight: torch.Tensor) -> GroupedWeight:
    """weight [E, N, K] (bf16/fp16, HF's gate_up_proj / down_proj layout) -> GroupedWeight."""
    if weight.dim() != 3:
        raise ValueError(f"expert weight must be [E, N, K], got {tuple(weight.shape)}")
    return GroupedWeight("bf16", weight.contiguous(), n=weight.shape[1], k=weight.shape[2])


def split_shared_experts(gate_up: torch.Tensor, down: torch.Tensor, n_shared: int):
    """A shared MLP gate_up [2*n*I, H] (gate rows then up rows), down [H, n*I] ->
    n experts: w13 [n, 2I, H], w2 [n, H, I], to stack after the routed experts (any dtype)."""
    inter = down.shape[1] // n_shared
    gate, up = gate_up.chunk(2, dim=0)  # [n*I, H] each
    w13 = torch.cat([gate.view(n_shared, inter, -1), up.view(n_shared, inter, -1)], dim=1)
    w2 = down.view(down.shape[0], n_shared, inter).permute(1, 0, 2)
    return w13.contiguous(), w2.contiguous()


def with_shared_experts(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_routed: int,
                        n_shared: int):
    """Append experts num_routed .. num_routed + n_shared - 1 with weight 1 to every token."""
    t = topk_ids.shape[0]
    ids = torch.arange(num_routed, num_routed + n_shared, device=topk_ids.device, dtype=topk_ids.dtype)
    weights = torch.ones(t, n_shared, device=topk_weights.device, dtype=topk_weights.dtype)
    return (torch.cat([topk_weights, weights], dim=1),
            torch.cat([topk_ids, ids.expand(t, n_shared)], dim=1))


def pick_configs(num_pairs: int, num_experts: int, fmt: str):
    """(gate/up config, down config) from the pairs per expert and the weight format.

    INT4 rule, from dsquant bench moe --sweep on an H200 (V2-Lite layer, 2026-12-03, the paired
    dequantization of moe_int4_loop): up to 24 pairs per expert, BLOCK_N 128 with 4 warps and 3
    stages is the fastest config at T = 8 (gate/up 47.1 us, down 24.1 us; BLOCK_N 64: 76.4 / 40.1)
    and at T = 64 (81.4 / 43.6 against 133.8 / 77.0); T = 1 takes the per-pair GEMV (_expert_gemvs)."""
    per_expert = num_pairs / num_experts
    if fmt == "int4" and per_expert <= 24:
        cfg = GemmConfig(16, 128, 128, 4, 3)
        return cfg, cfg
    if per_expert <= 2:
        block_m, block_n, block_k, warps, stages = 16, 64, 128, 4, 4
    elif per_expert <= 24:
        block_m, block_n, block_k, warps, stages = 16, 64, 128, 4, 3
    elif per_expert <= 96:
        block_m, block_n, block_k, warps, stages = 32, 64, 128, 4, 3
    else:
        block_m, block_n, block_k, warps, stages = 64, 128, 64, 8, 3
    if fmt in ("fp8", "int4"):
        block_k = 128  # fp8: the scale block; int4: the packing tile
    cfg = GemmConfig(block_m, block_n, block_k, warps, stages)
    return cfg, cfg


def fused_moe(hidden: torch.Tensor, weights: MoeWeights, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared_output: torch.Tensor | None = None,
              configs: tuple[GemmConfig, GemmConfig] | None = None, residual: torch.Tensor | None = None,
              n_shared: int = 0, defer_sum: bool = False):
    """hidden [T, H], topk_weights [T, P], topk_ids [T, P] (the last n_shared columns folded shared
    experts), shared_output / residual [T, H] or None -> [T, H] (see module docstring); defer_sum:
    moe_sum's arguments (MoESumInputs) instead, for a later launch to sum."""
    t, h = hidden.shape
    if h != weights.w13.k:
        raise ValueError(f"hidden size {h} differs from the experts' {weights.w13.k}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={t}, top_k]")
    pieces = expert_outputs(hidden, weights, topk_ids, configs)  # [T, P, H]
    if defer_sum:
        return MoESumInputs(pieces, topk_weights.float(), n_shared, shared_output, residual, (t, h))
    return moe_sum(pieces, topk_weights.float(), n_shared, shared_output, residual)


def expert_outputs(hidden: torch.Tensor, weights: MoeWeights, topk_ids: torch.Tensor,
                   configs: tuple[GemmConfig, GemmConfig] | None = None) -> torch.Tensor:
    """hidden [T, H], topk_ids [T, P] -> unweighted expert outputs [T, P, H] in hidden's dtype:
    out[t, j] = down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]."""
    t, h = hidden.shape
    top_k = topk_ids.shape[1]
    fmt = weights.w13.format
    inter = weights.w13.n // 2
    act = torch.empty(t * top_k, inter, dtype=hidden.dtype, device=hidden.device)  # [T*P, I]
    out = torch.empty(t * top_k, h, dtype=hidden.dtype, device=hidden.device)  # [T*P, H]
    if fmt == "int4" and configs is None and 0 < t * top_k <= MOE_GEMV_MAX_PAIRS:
        _expert_gemvs(hidden, weights, topk_ids.contiguous(), act, out)
        return out.view(t, top_k, h)
    if fmt == "fp8" and MOE_PAIR_MMA_FP8 and configs is None and 0 < t * top_k <= MOE_GEMV_MAX_PAIRS:
        _fp8_pairs(hidden, weights, topk_ids.contiguous(), act, out)
        return out.view(t, top_k, h)
    if fmt == "int4" and configs is None and _dequantize_first(weights, t * top_k, hidden.element_size()):
        weights = MoeWeights(dequantize_int4_grouped(weights.w13, hidden.dtype),
                             dequantize_int4_grouped(weights.w2, hidden.dtype))
        fmt = "bf16"
    cfg13, cfg2 = configs or pick_configs(t * top_k, weights.num_experts, fmt)
    if t <= ONE_BLOCK_PER_PAIR_MAX_TOKENS and configs is None:  # no align launch
        align = one_block_per_pair(topk_ids, cfg13.block_m)
    else:
        align = moe_align_block_size(topk_ids, weights.num_experts, cfg13.block_m)
    upcast = os.environ.get("TRITON_INTERPRET") == "1"
    # fp8 decode: the activations are quantized inside the GEMMs (no quant launches) on a GPU
    fuse_quant = (fmt == "fp8" and t <= FP8_FUSE_QUANT_MAX_TOKENS and configs is None and hidden.is_cuda
                  and not upcast)
    a, a_scale = _fp8_act(hidden, fmt, fuse_quant)
    moe_gemm(a, weights.w13, align, act, cfg13, a_row_div=top_k, gated=True, a_scale=a_scale,
             fp8_upcast=upcast)
    a, a_scale = _fp8_act(act, fmt, fuse_quant)
    moe_gemm(a, weights.w2, align, out, cfg2, a_row_div=1, gated=False, a_scale=a_scale, fp8_upcast=upcast)
    return out.view(t, top_k, h)


def _fp8_act(x: torch.Tensor, fmt: str, in_kernel: bool):
    """(GEMM input, its scales): fp8 experts get x quantized here (quantize_act_fp8), unless the
    GEMM quantizes it (in_kernel: x and None); other formats x as it is."""
    if fmt != "fp8" or in_kernel:
        return x, None
    return quantize_act_fp8(x)


def _dequantize_first(weights: MoeWeights, pairs: int, elem_bytes: int) -> bool:
    """Whether a call with this many pairs runs INT4 experts dequantized (see DEQUANT_MIN_PAIRS_PER_EXPERT)."""
    e = weights.num_experts
    dense = e * (weights.w13.n * weights.w13.k + weights.w2.n * weights.w2.k) * elem_bytes
    return pairs >= DEQUANT_MIN_PAIRS_PER_EXPERT * e and dense <= DEQUANT_MAX_BYTES


# The INT4 decode pairs on the tensor cores with split-K (moe_pair_mma.py) instead of the per-pair
# GEMVs: (block_n, num_warps, split_k or None for the GEMV's rule) for gate/up and for down.
# H100, V2-Lite layer at one token, 8 layers' weights cycled, graph replays (`MOEGEMV_ARGS="--tokens 1
# --kernels gemv,pair --gemv-default" bash scripts/gpu.sh moegemv`, 2026-12-06): gate/up 13.68 us at
# (64, 2 warps, split 4) against the GEMV's 18.72; down 8.73 against 12.24. End to end (same day, H100,
# `bench engine --schemes int4`, batch 1): 588.4 tok/s against the GEMVs' 543.4 (1.699 against 1.840 ms a
# token); the trained-model GPU test and the demo's table unchanged with it on. DSQUANT_MOE_PAIR_MMA=0: the GEMVs.
# With the paired code order (24th session, H100): 12.90 / 8.57 us, engine 591.2 against 581.4 tok/s.
MOE_PAIR_MMA = os.environ.get("DSQUANT_MOE_PAIR_MMA", "1") == "1"
PAIR_MMA_CONFIGS = ((64, 2, 4), (64, 2, 4))
# Past this many pairs the down projection runs on the grouped GEMM (one block per pair) instead. H100,
# same probe with the paired code order (`MOEGEMV_ARGS="--tokens 1,2,4,8 --kernels pair,grouped"`,
# 2026-12-06, 24th session), us: T = 1 (8 pairs) pair 8.57 / grouped 9.11; T = 2 (16) 13.07 / 11.31.
# Gate/up keeps the pair MMA at T = 2 (21.13 against 25.25).
PAIR_MMA_DOWN_MAX_PAIRS = 8
# FP8 experts' decode pairs the same way (moe_pair_mma_fp8) instead of the grouped GEMMs on one block
# per pair: off, it lost (same H100 probe, `bash scripts/gpu.sh moepf8`: best gate/up 21.28 us against the
# grouped GEMM's 18.93, down 12.52 against 10.63); PAIR_FP8_CONFIGS as PAIR_MMA_CONFIGS plus block_m
MOE_PAIR_MMA_FP8 = os.environ.get("DSQUANT_MOE_PAIR_MMA_FP8", "0") == "1"
PAIR_FP8_CONFIGS = ((64, 4, None, 64), (64, 4, None, 64))  # (block_n, num_warps, split_k, block_m)


def _fp8_pairs(hidden, weights: MoeWeights, ids, act, out) -> None:
    """Decode-sized FP8 batches on moe_pair_mma_fp8: act [T*P, I] and out [T*P, H] are written."""
    (bn13, w13, s13, bm13), (bn2, w2, s2, bm2) = PAIR_FP8_CONFIGS
    upcast = os.environ.get("TRITON_INTERPRET") == "1"
    a, a_s = quantize_act_fp8(hidden)
    moe_pair_mma_fp8(a, a_s, weights.w13, ids, act, ids.shape[1], True, None, bn13, w13, s13, block_m=bm13,
                     fp8_upcast=upcast)
    a, a_s = quantize_act_fp8(act)
    moe_pair_mma_fp8(a, a_s, weights.w2, ids, out, 1, False, None, bn2, w2, s2, block_m=bm2, fp8_upcast=upcast)


def _expert_gemvs(hidden, weights: MoeWeights, ids, act, out) -> None:
    """Decode-sized INT4 batches: per-pair GEMVs, no alignment. act [T*P, I] and out [T*P, H] are
    written. bench moe --sweep int4 on the H200 (2026-11-29): block_n 16 with 1 warp and
    default_split_k's split fastest for both projections at T = 1 and 2. FP8 stays on align + the
    grouped GEMMs: its per-pair GEMV (moe_gemv_fp8) measured 32.5 | 17.6 us at T = 1 against the
    grouped kernel's 15.4 | 9.6 plus a 5.2 us align."""
    top_k = ids.shape[1]
    if MOE_PAIR_MMA and hidden.dtype in (torch.bfloat16, torch.float16):  # fp32 (CPU kernel path): the GEMVs
        (bn13, w13, s13), (bn2, w2, s2) = PAIR_MMA_CONFIGS
        moe_pair_mma_int4(hidden, weights.w13, ids, act, a_row_div=top_k, gated=True, block_n=bn13,
                          num_warps=w13, split_k=s13)
        if ids.numel() <= PAIR_MMA_DOWN_MAX_PAIRS:
            moe_pair_mma_int4(act, weights.w2, ids, out, a_row_div=1, gated=False, block_n=bn2, num_warps=w2,
                              split_k=s2)
        else:
            cfg2 = pick_configs(ids.numel(), weights.num_experts, "int4")[1]
            moe_gemm(act, weights.w2, one_block_per_pair(ids, cfg2.block_m), out, cfg2, a_row_div=1, gated=False)
        return
    moe_gemv_int4(hidden, weights.w13, ids, act, a_row_div=top_k, gated=True, block_n=16, num_warps=1)
    # right after the gate/up launch: the ids are two launches old, so the down GEMV may read them
    # and its first weight tiles before its PDL wait
    moe_gemv_int4(act, weights.w2, ids, out, a_row_div=1, gated=False, block_n=16, num_warps=1, early_ids=True)
