"""MoE router logits for decode-sized batches: fp32 logits = x @ W^T from bf16/fp16 x and W.

Layouts: x [T, H] (unit last stride), weight [E, H] contiguous -> logits fp32 [T, E]. Products of
two bf16 (or fp16) values are exact in fp32 and are summed in fp32, as the reference's
linear(x.float(), weight.float()) does (the order of the sum differs). One program per (token,
BLOCK_E experts), the hidden dimension in BLOCK_K tiles. At batch-1 decode this replaces cuBLAS's
fp32-output GEMM (5.1 us per V2-Lite layer on an H200) for small T; beyond ROUTER_GEMV_MAX_T the
caller keeps the GEMM.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROUTER_GEMV_MAX_T = 16


@triton.jit
def _router_logits_kernel(x_ptr, stride_xt, w_ptr, out_ptr, num_experts, hidden,
                          BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BLOCK_E]
    t = tl.program_id(1)
    emask = e < num_experts
    acc = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < hidden
        x = tl.load(x_ptr + t * stride_xt + k, mask=kmask, other=0.0).to(tl.float32)  # [BLOCK_K]
        w = tl.load(w_ptr + e[:, None].to(tl.int64) * hidden + k[None, :], mask=emask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_E, BLOCK_K]
        acc += w * x[None, :]
    tl.store(out_ptr + t * num_experts + e, tl.sum(acc, 1), mask=emask)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H], weight [E, H] (same 16-bit float dtype) -> fp32 logits [T, E]."""
    t, hidden = x.shape
    num_experts = weight.shape[0]
    if weight.shape[1] != hidden or not weight.is_contiguous() or x.stride(-1) != 1:
        raise ValueError(f"router_logits: x [T, H] with unit last stride and contiguous weight [E, H={hidden}] "
                         f"expected, got {tuple(x.shape)} and {tuple(weight.shape)}")
    out = torch.empty(t, num_experts, dtype=torch.float32, device=x.device)
    if t:
        block_e = 2 if num_experts <= 128 else 4
        block_k = min(1024, triton.next_power_of_2(hidden))
        _router_logits_kernel[(triton.cdiv(num_experts, block_e), t)](
            x, x.stride(0), weight, out, num_experts, hidden, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4)
    return out
