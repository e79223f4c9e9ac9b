"""Pure-torch references for the MoE kernels (float64), used by the tests.

moe_experts_reference is transformers' experts forward (a loop over the experts that received
pairs, index_add of the weighted outputs) on dense per-expert weights, in float64; with
fp8_acts it first rounds each GEMM's input the way the FP8 path does (per token per 128
channels), so the FP8 kernels are compared with the same quantised activations.
"""
from __future__ import annotations

import torch

from dsquant.formats.fp8_block import dequantize_fp8_block
from dsquant.runtime.kernels.moe.fused_moe_fp8 import quantize_act_fp8_torch


def fp8_act_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> the values the FP8 path feeds its GEMM (fp8 * scale), float64."""
    q, s = quantize_act_fp8_torch(x)  # [M, K], [M, ceil(K/128)]
    return q.double() * s.double().repeat_interleave(128, dim=1)[:, : x.shape[1]]


def dequantize_fp8_experts(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """float8 [E, N, K] + scale_inv [E, N/128, K/128] -> float64 [E, N, K]."""
    return torch.stack([dequantize_fp8_block(weight[e], scale_inv[e], torch.float64)
                        for e in range(weight.shape[0])])


def moe_experts_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          fp8_acts: bool = False) -> torch.Tensor:
    """hidden [T, H], dense w13 [E, 2I, H], w2 [E, H, I], topk [T, k] -> float64 [T, H]."""
    x = hidden.double()
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == e)
        xe = x[token]  # [n_e, H]
        if fp8_acts:
            xe = fp8_act_roundtrip(hidden[token])
        gate, up = (xe @ w13[e].double().t()).chunk(2, dim=-1)  # [n_e, I] each
        act = torch.nn.functional.silu(gate) * up
        if fp8_acts:
            act = fp8_act_roundtrip(act.to(hidden.dtype))
        y = act @ w2[e].double().t()  # [n_e, H]
        out.index_add_(0, token, y * topk_weights[token, slot].double().unsqueeze(-1))
    return out
