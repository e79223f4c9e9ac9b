"""MoE router logits for decode-sized batches: fp32 logits = x @ W^T from bf16/fp16 x and W.

Layouts: x [T, H] (unit last stride), weight [E, H] contiguous -> logits fp32 [T, E]. Products of
two bf16 (or fp16) values are exact in fp32 and are summed in fp32, as the reference's
linear(x.float(), weight.float()) does (the order of the sum differs). One program per (token,
BLOCK_E experts), the hidden dimension in BLOCK_K tiles. At batch-1 decode this replaces cuBLAS's
fp32-output GEMM (5.1 us per V2-Lite layer on an H200) for small T; beyond ROUTER_GEMV_MAX_T the
caller keeps the GEMM.

router_route fuses the routing (moe_route.route_row) into the same launch: each program stores its
experts' logits and counts itself in on the token's counter (int32, zero between launches); the last
of the token's programs to arrive routes the row and resets the counter. The runtime takes it up to
FUSED_ROUTE_MAX_T tokens at hidden sizes of at least FUSED_ROUTE_MIN_HIDDEN, from
scripts/router_route_probe.py on an H100 (2026-12-06; 26 routers cycled in one CUDA graph, us per
call, two launches against one): V3's router (256 experts, hidden 7168) 16.05 / 13.58 at T = 1, 15.76
/ 14.52 at T = 16, bit-identical; V2-Lite's (64, 2048) 3.97 / 5.42 at T = 1, 4.44 / 6.15 at T = 16,
where the last program's serial routing outlasts the small GEMV (and the V2-Lite engine at batch 1
ran 486.8 against 496.0 tok/s with it on). The ids equal the two launches'; softmax weights agree to
fp32 rounding only (this launch's 4 warps sum the denominator in another order than moe_route's 1-2).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.moe.moe_route import route_outputs, route_plan, route_row

ROUTER_GEMV_MAX_T = 16
FUSED_ROUTE_MAX_T = 16
FUSED_ROUTE_MIN_HIDDEN = 4096


def fused_route_takes(tokens: int, hidden: int) -> bool:
    """Whether router_route (one launch) serves T = tokens rows of a hidden-wide router."""
    return tokens <= FUSED_ROUTE_MAX_T and hidden >= FUSED_ROUTE_MIN_HIDDEN


@triton.jit
def _logits_block(x_ptr, stride_xt, w_ptr, t, e, emask, hidden, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  PDL: tl.constexpr = False):
    """fp32 logits [BLOCK_E] of token t for experts e [BLOCK_E]. The first weight tile is read before
    the PDL wait (pdl.py), each next one a tile ahead of its use."""
    acc = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
    rows = w_ptr + e[:, None].to(tl.int64) * hidden  # [BLOCK_E, 1]
    k = tl.arange(0, BLOCK_K)
    w = tl.load(rows + k[None, :], mask=emask[:, None] & (k < hidden)[None, :], other=0.0)  # [BLOCK_E, BLOCK_K]
    pdl.enter(PDL)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_xt + k, mask=k < hidden, other=0.0).to(tl.float32)  # [BLOCK_K]
        k_next = k + BLOCK_K
        w_next = tl.load(rows + k_next[None, :], mask=emask[:, None] & (k_next < hidden)[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
    return tl.sum(acc, 1)


@triton.jit
def _router_logits_kernel(x_ptr, stride_xt, w_ptr, out_ptr, num_experts, hidden,
                          BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (cdiv(E, BLOCK_E), T): out [T, E] fp32."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BLOCK_E]
    t = tl.program_id(1)
    emask = e < num_experts
    tl.store(out_ptr + t * num_experts + e,
             _logits_block(x_ptr, stride_xt, w_ptr, t, e, emask, hidden, BLOCK_E, BLOCK_K, PDL), mask=emask)


@triton.jit
def _router_route_kernel(x_ptr, stride_xt, w_ptr, logits_ptr, counters_ptr, bias_ptr, weights_ptr, ids_ptr,
                         stride_weights, stride_ids, hidden, num_experts, per_group, n_group, scaling,
                         BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, TOP_K: tl.constexpr, N_SHARED: tl.constexpr,
                         TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, METHOD: tl.constexpr, NORM: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_PER: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_S: tl.constexpr):
    """Grid (cdiv(E, BLOCK_E), T): logits fp32 [T, E] (scratch), counters int32 [T] (zero on entry and
    exit), weights fp32 / ids int32 [T, top_k + n_shared] as moe_route's; BLOCK_H: the hidden tile;
    the other constexprs are route_row's."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BLOCK_E]
    t = tl.program_id(1).to(tl.int64)
    emask = e < num_experts
    row = logits_ptr + t * num_experts
    tl.store(row + e, _logits_block(x_ptr, stride_xt, w_ptr, t, e, emask, hidden, BLOCK_E, BLOCK_H), mask=emask)
    tl.debug_barrier()  # every thread's logits are written before the counter moves
    arrived = tl.atomic_add(counters_ptr + t, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:  # the token's last program: all of its row is written
        route_row(row, bias_ptr, weights_ptr + t * stride_weights, ids_ptr + t * stride_ids, num_experts,
                  per_group, n_group, scaling, TOP_K, N_SHARED, TOPK_GROUP, SIGMOID, METHOD, NORM, BLOCK_G,
                  BLOCK_PER, BLOCK_K, BLOCK_S, FRESH_ROW=True)
        tl.atomic_xchg(counters_ptr + t, 0, sem="relaxed", scope="gpu")


def _logits_launch(name: str, x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int, int]:
    """Check a router GEMV's x [T, H] and weight [E, H]; (T, E, BLOCK_E experts, BLOCK_K hidden) a program."""
    t, hidden = x.shape
    num_experts = weight.shape[0]
    if weight.shape[1] != hidden or not weight.is_contiguous() or x.stride(-1) != 1:
        raise ValueError(f"{name}: x [T, H] with unit last stride and contiguous weight [E, H={hidden}] "
                         f"expected, got {tuple(x.shape)} and {tuple(weight.shape)}")
    return t, num_experts, 2 if num_experts <= 128 else 4, min(1024, triton.next_power_of_2(hidden))


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H], weight [E, H] (same 16-bit float dtype) -> fp32 logits [T, E]."""
    t, num_experts, block_e, block_k = _logits_launch("router_logits", x, weight)
    out = torch.empty(t, num_experts, dtype=torch.float32, device=x.device)
    if t:
        _router_logits_kernel[(triton.cdiv(num_experts, block_e), t)](
            x, x.stride(0), weight, out, num_experts, x.shape[1], BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4,
            **pdl.launch(x.device))
    return out


def router_route(x: torch.Tensor, weight: torch.Tensor, counters: torch.Tensor, top_k: int, scoring: str = "softmax",
                 topk_method: str = "greedy", n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = False,
                 routed_scaling_factor: float = 1.0, e_score_correction_bias: torch.Tensor | None = None,
                 n_shared: int = 0, out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """router_logits then moe_route in one launch: x [T, H], weight [E, H] (same 16-bit float dtype),
    counters int32 [>= T] zeros (left zero) -> (topk_weights fp32 [T, top_k + n_shared], topk_ids int32)."""
    t, num_experts, block_e, block_h = _logits_launch("router_route", x, weight)
    if counters.dtype != torch.int32 or counters.numel() < t or counters.device != x.device:
        raise ValueError(f"router_route: counters must be int32 with >= {t} elements on {x.device}, got "
                         f"{counters.dtype} {tuple(counters.shape)} on {counters.device}")
    bias, args, consts = route_plan(num_experts, top_k, scoring, topk_method, n_group, topk_group, norm_topk_prob,
                                    routed_scaling_factor, e_score_correction_bias, n_shared)
    weights, ids = route_outputs(t, top_k + n_shared, x.device, out)
    if t:
        logits = torch.empty(t, num_experts, dtype=torch.float32, device=x.device)  # [T, E] scratch
        _router_route_kernel[(triton.cdiv(num_experts, block_e), t)](
            x, x.stride(0), weight, logits, counters, logits if bias is None else bias, weights, ids,
            weights.stride(0), ids.stride(0), x.shape[1], args["num_experts"], args["per_group"], args["n_group"],
            args["scaling"], BLOCK_E=block_e, BLOCK_H=block_h, **consts, num_warps=4)
    return weights, ids
