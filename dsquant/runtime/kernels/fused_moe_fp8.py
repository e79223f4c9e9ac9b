"""FP8 block experts: per-token, per-128-channel activation quantisation and the weight wrapper.

Weights (DeepSeek-V3 native, stacked over E): weight float8_e4m3fn [E, N, K], weight_scale_inv
fp32 [E, ceil(N/128), ceil(K/128)]; W = fp8 * scale_inv per 128x128 block.
Activations x [M, K] -> (x_fp8 float8_e4m3fn [M, K], x_scale fp32 [M, ceil(K/128)]) with
x_scale = max(amax of the 128 channels, 1e-10) / 448 and x_fp8 = round_to_e4m3(x / x_scale).
quantize_act_fp8 uses the Triton kernel on CUDA and the torch path (same formula) elsewhere:
the Triton interpreter casts to fp8 wrongly (Triton issue 8322).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.formats import FP8_E4M3_MAX, fp8_block_shape, quantize_fp8_activations
from dsquant.runtime.kernels.moe_gemm import GroupedWeight

ACT_GROUP = 128


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s,
                      FP8_MAX: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)  # [GROUP]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10) / FP8_MAX
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_s + g, scale)


def quantize_act_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], scale fp32 [M, ceil(K/128)]) in torch (formats' quantizer)."""
    return quantize_fp8_activations(x, ACT_GROUP)


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16) -> (fp8 [M, K], scale fp32 [M, ceil(K/128)])."""
    if not x.is_cuda:
        return quantize_act_fp8_torch(x)
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, triton.cdiv(k, ACT_GROUP), dtype=torch.float32, device=x.device)
    if m:
        _act_quant_kernel[(m, s.shape[1])](x, q, s, k, x.stride(0), q.stride(0), s.stride(0),
                                           FP8_MAX=FP8_E4M3_MAX, GROUP=ACT_GROUP)
    return q, s


def fp8_experts(weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> GroupedWeight:
    """weight float8_e4m3fn [E, N, K] + weight_scale_inv fp32 [E, N/128, K/128] -> GroupedWeight."""
    if weight.dim() != 3 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 expert weight must be float8_e4m3fn [E, N, K], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    e, n, k = weight.shape
    expected = (e, *fp8_block_shape(n, k))
    if tuple(weight_scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv has shape {tuple(weight_scale_inv.shape)}, expected {expected}")
    return GroupedWeight("fp8", weight.contiguous(), weight_scale_inv.float().contiguous(), n=n, k=k)
