"""MoE routing in one launch: router logits -> top-k expert ids and weights.

    logits fp32 [T, E] (row stride free, unit column stride), e_score_correction_bias [E] (any
    float dtype, noaux_tc only)  ->  topk_weights fp32 [T, top_k + n_shared],
                                     topk_ids int32 [T, top_k + n_shared]

The same routing as models/routing.select_experts (DeepSeek V2 / V3, see its docstring):
  scores  = softmax(logits) or sigmoid(logits)
  greedy               top-k of scores
  group_limited_greedy group score = max score of the group; top-k inside the topk_group best groups
  noaux_tc             choice = scores + bias; group score = sum of the group's two best choices;
                       top-k of choice inside the topk_group best groups; weights = unbiased scores
  then weights /= sum + 1e-20 if norm_topk_prob, and weights *= routed_scaling_factor.
One program per token. The row is held as a [BLOCK_G, BLOCK_PER] tile, group g in row g (greedy: one
group of E), so E <= 1024 experts fit; top-k and the group choice are repeated arg-max passes
(ties go to the lower index; on real-valued logits they have probability zero). The ids come out
in the order chosen (best first); the reference's order is unspecified, compare them as sets.
int32 ids are what moe_align_block_size reads, so no cast follows.
n_shared > 0 appends the shared experts run as always-selected experts after the E routed ones
(fused_moe.with_shared_experts in the same launch): columns top_k + i hold id E + i, weight 1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl

SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
MAX_EXPERTS = 1024


@triton.jit
def route_row(row_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, per_group, n_group, scaling,
              TOP_K: tl.constexpr, N_SHARED: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr,
              METHOD: tl.constexpr, NORM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_PER: tl.constexpr,
              BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, FRESH_ROW: tl.constexpr = False):
    """Route one token: its fp32 logits [E] at row_ptr -> weights_ptr [top_k + n_shared] fp32 and
    ids_ptr [same] int32 (the module docstring's rule). METHOD: 0 greedy, 1 group_limited_greedy,
    2 noaux_tc. FRESH_ROW: the row was just written by other programs of the launch (router_gemv's
    fused kernel), so it is read through L2 (.cg)."""
    g = tl.arange(0, BLOCK_G)[:, None]  # [BLOCK_G, 1]
    j = tl.arange(0, BLOCK_PER)[None, :]  # [1, BLOCK_PER]
    expert = g * per_group + j  # [BLOCK_G, BLOCK_PER]
    valid = (g < n_group) & (j < per_group)
    neg_inf = float("-inf")
    if FRESH_ROW:
        logits = tl.load(row_ptr + expert, mask=valid, other=neg_inf, cache_modifier=".cg")
    else:
        logits = tl.load(row_ptr + expert, mask=valid, other=neg_inf)
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        row_max = tl.max(tl.max(logits, axis=1), axis=0)
        e = tl.exp(logits - row_max)  # masked slots: exp(-inf) = 0
        scores = e / tl.sum(tl.sum(e, axis=1), axis=0)
    scores = tl.where(valid, scores, neg_inf)
    if METHOD == 2:
        bias = tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, scores + bias, neg_inf)
    else:
        choice = scores
    if METHOD != 0:
        best = tl.max(choice, axis=1)  # [BLOCK_G]
        if METHOD == 1:
            group_score = best
        else:
            best_j = tl.argmax(choice, axis=1)  # first arg-max of each group
            rest = tl.where(j == best_j[:, None], neg_inf, choice)
            group_score = best + tl.max(rest, axis=1)  # sum of the two best
        group_score = tl.where(tl.arange(0, BLOCK_G) < n_group, group_score, neg_inf)
        gi = tl.arange(0, BLOCK_G)
        keep = tl.zeros([BLOCK_G], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.argmax(group_score, axis=0)
            keep = tl.where(gi == top, 1, keep)
            group_score = tl.where(gi == top, neg_inf, group_score)
        choice = tl.where(keep[:, None] != 0, choice, neg_inf)
    k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_id = tl.zeros([BLOCK_K], dtype=tl.int32)
    big = BLOCK_G * BLOCK_PER
    for i in tl.static_range(TOP_K):
        m = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == m, expert, big), axis=1), axis=0)  # lowest id at max
        hit = (expert == pick) & valid  # padding slots alias the next group's ids
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)
        top_w = tl.where(k == i, w, top_w)
        top_id = tl.where(k == i, pick, top_id)
        choice = tl.where(hit, neg_inf, choice)
    if NORM:
        top_w = top_w / (tl.sum(top_w, axis=0) + 1e-20)
    top_w = top_w * scaling
    tl.store(weights_ptr + k, top_w, mask=k < TOP_K)
    tl.store(ids_ptr + k, top_id, mask=k < TOP_K)
    if N_SHARED > 0:
        s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
        tl.store(weights_ptr + TOP_K + s, tl.full([BLOCK_S], 1.0, tl.float32), mask=s < N_SHARED)
        tl.store(ids_ptr + TOP_K + s, num_experts + s, mask=s < N_SHARED)


@triton.jit
def _moe_route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, per_group, n_group,
                      stride_logits, stride_weights, stride_ids, scaling,
                      TOP_K: tl.constexpr, N_SHARED: tl.constexpr, TOPK_GROUP: tl.constexpr,
                      SIGMOID: tl.constexpr,
                      METHOD: tl.constexpr, NORM: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_PER: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Grid (T,): token t's row of logits routed by route_row."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    route_row(logits_ptr + t * stride_logits, bias_ptr, weights_ptr + t * stride_weights, ids_ptr + t * stride_ids,
              num_experts, per_group, n_group, scaling, TOP_K, N_SHARED, TOPK_GROUP, SIGMOID, METHOD, NORM,
              BLOCK_G, BLOCK_PER, BLOCK_K, BLOCK_S)


def route_plan(num_experts: int, top_k: int, scoring: str = "softmax", topk_method: str = "greedy",
               n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = False,
               routed_scaling_factor: float = 1.0, e_score_correction_bias: torch.Tensor | None = None,
               n_shared: int = 0) -> tuple[torch.Tensor | None, dict, dict]:
    """Check a routing (models.routing.RoutingConfig's fields) for route_row: (the bias to pass, or None
    when it is never read; route_row's run-time arguments after the pointers; its constexprs)."""
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"logits have {num_experts} experts; moe_route takes 1 .. {MAX_EXPERTS}")
    if scoring not in SCORING:
        raise ValueError(f"scoring must be one of {SCORING}, got {scoring!r}")
    if topk_method not in TOPK_METHODS:
        raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {topk_method!r}")
    if topk_method == "greedy":
        n_group, topk_group = 1, 1
    elif num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"n_group {n_group} must divide the {num_experts} experts and topk_group "
                         f"{topk_group} lie in [1, n_group]")
    per_group = num_experts // n_group
    if not 1 <= top_k <= topk_group * per_group:
        raise ValueError(f"top_k {top_k} must lie in [1, {topk_group * per_group}] (experts in the kept groups)")
    bias = None
    if topk_method == "noaux_tc":
        if e_score_correction_bias is None or e_score_correction_bias.shape != (num_experts,):
            got = None if e_score_correction_bias is None else tuple(e_score_correction_bias.shape)
            raise ValueError(f"topk_method 'noaux_tc' needs e_score_correction_bias [{num_experts}], got {got}")
        if per_group < 2:
            raise ValueError(f"noaux_tc scores a group by its two best experts; groups have {per_group}")
        bias = e_score_correction_bias.contiguous()
    if n_shared < 0:
        raise ValueError(f"n_shared must be >= 0, got {n_shared}")
    block_g, block_per = triton.next_power_of_2(n_group), triton.next_power_of_2(per_group)
    args = dict(num_experts=num_experts, per_group=per_group, n_group=n_group, scaling=float(routed_scaling_factor))
    consts = dict(TOP_K=top_k, N_SHARED=n_shared, TOPK_GROUP=topk_group, SIGMOID=scoring == "sigmoid",
                  METHOD=TOPK_METHODS.index(topk_method), NORM=bool(norm_topk_prob), BLOCK_G=block_g,
                  BLOCK_PER=block_per, BLOCK_K=triton.next_power_of_2(top_k),
                  BLOCK_S=triton.next_power_of_2(max(n_shared, 1)))
    return bias, args, consts


def route_outputs(t: int, cols: int, device, out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """(weights fp32 [T, cols], ids int32 [T, cols]): `out` checked, or new tensors."""
    if out is None:
        return (torch.empty(t, cols, dtype=torch.float32, device=device),
                torch.empty(t, cols, dtype=torch.int32, device=device))
    weights, ids = out
    if weights.shape != (t, cols) or weights.dtype != torch.float32 or ids.shape != (t, cols) \
            or ids.dtype != torch.int32 or weights.stride(1) != 1 or ids.stride(1) != 1:
        raise ValueError(f"out must be (fp32 [T={t}, top_k + n_shared={cols}], int32 [T, {cols}]) with unit column "
                         f"stride, got {weights.dtype} {tuple(weights.shape)} and {ids.dtype} {tuple(ids.shape)}")
    return weights, ids


def moe_route(logits: torch.Tensor, top_k: int, scoring: str = "softmax", topk_method: str = "greedy",
              n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = False,
              routed_scaling_factor: float = 1.0, e_score_correction_bias: torch.Tensor | None = None,
              out: tuple[torch.Tensor, torch.Tensor] | None = None, n_shared: int = 0):
    """logits fp32 [T, E] -> (topk_weights fp32 [T, top_k + n_shared], topk_ids int32 [T, same]).

    The arguments are models.routing.RoutingConfig's fields (see the module docstring); `out`
    takes preallocated (weights, ids) to fill; n_shared appends ids E .. E + n_shared - 1, weight 1."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be fp32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    if logits.shape[1] and logits.stride(1) != 1:
        raise ValueError("logits must be contiguous along the expert dimension")
    t, num_experts = logits.shape
    bias, args, consts = route_plan(num_experts, top_k, scoring, topk_method, n_group, topk_group, norm_topk_prob,
                                    routed_scaling_factor, e_score_correction_bias, n_shared)
    weights, ids = route_outputs(t, top_k + n_shared, logits.device, out)
    if t:
        _moe_route_kernel[(t,)](
            logits, logits if bias is None else bias, weights, ids, args["num_experts"], args["per_group"],
            args["n_group"], logits.stride(0), weights.stride(0), ids.stride(0), args["scaling"], **consts,
            num_warps=route_warps(consts), **pdl.launch(logits.device))
    return weights, ids


def route_warps(consts: dict) -> int:
    """Warps of a program that routes one row: 1 up to 64 slots, 2 up to 256, else 4."""
    slots = consts["BLOCK_G"] * consts["BLOCK_PER"]
    return 1 if slots <= 64 else (2 if slots <= 256 else 4)
