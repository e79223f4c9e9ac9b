"""FP8 block experts: per-token, per-128-channel activation quantisation and the weight wrapper.

Weights (DeepSeek-V3 native, stacked over E): weight float8_e4m3fn [E, N, K], weight_scale_inv
fp32 [E, ceil(N/128), ceil(K/128)]; W = fp8 * scale_inv per 128x128 block.
Activations x [M, K] -> (x_fp8 float8_e4m3fn [M, K], x_scale fp32 [M, ceil(K/128)]) with
x_scale = max(amax of the 128 channels, 1e-10) / 448 and x_fp8 = round_to_e4m3(x / x_scale).
quantize_act_fp8 uses fp8_quant.per_token_group_quant_fp8 on CUDA (IEEE division, as torch) and
formats.fp8_block.quantize_fp8_activations elsewhere: the Triton interpreter casts to fp8 wrongly (Triton
issue 8322).
"""
from __future__ import annotations

import torch

from dsquant.formats.fp8_block import fp8_block_shape, quantize_fp8_activations
from dsquant.runtime.kernels.gemm.fp8_quant import per_token_group_quant_fp8
from dsquant.runtime.kernels.moe.moe_gemm import GroupedWeight

ACT_GROUP = 128


def quantize_act_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], scale fp32 [M, ceil(K/128)]) in torch (formats' quantizer)."""
    return quantize_fp8_activations(x, ACT_GROUP)


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16) -> (fp8 [M, K], scale fp32 [M, ceil(K/128)])."""
    if not x.is_cuda:
        return quantize_act_fp8_torch(x)
    return per_token_group_quant_fp8(x, ACT_GROUP)


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
