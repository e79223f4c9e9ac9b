"""INT4 experts: repack AutoAWQ "gemm" expert tensors into the grouped GEMM's layout, at load.

AWQ per expert (stacked over E): qweight int32 [E, K, N/8] (8 nibbles along N in the order
0,2,4,6,1,3,5,7), qzeros int32 [E, K/G, N/8] (same order), scales [E, K/G, N]; W^T = (q - z) * s.
Kernel layout (moe_gemm "int4"): qweight int32 [E, N, K/8] packed along K in plain order (nibble i
of word j is k = 8j + i), so each output row's codes are contiguous along K and a small BLOCK_N
still reads whole 32-byte sectors; zeros uint8 [E, K/G, N]; scales [E, K/G, N] unchanged.
"""
from __future__ import annotations

import torch

from dsquant.formats import pack_gptq_qweight, unpack_awq
from dsquant.runtime.kernels.moe_gemm import GroupedWeight

GROUP_SIZES = (32, 64, 128)


def int4_experts_from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                          group_size: int) -> GroupedWeight:
    """Stacked AWQ gemm tensors of E experts -> GroupedWeight("int4") (see module docstring)."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 experts support group_size in {GROUP_SIZES}, got {group_size}")
    if qweight.dim() != 3 or qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32 [E, K, N/8], got {qweight.dtype} {tuple(qweight.shape)}")
    e, k, n8 = qweight.shape
    n = n8 * 8
    if k % group_size or k % 8:
        raise ValueError(f"in_features K={k} must be a multiple of group_size {group_size} and of 8")
    if tuple(qzeros.shape) != (e, k // group_size, n8):
        raise ValueError(f"qzeros has shape {tuple(qzeros.shape)}, expected {(e, k // group_size, n8)}")
    if tuple(scales.shape) != (e, k // group_size, n):
        raise ValueError(f"scales has shape {tuple(scales.shape)}, expected {(e, k // group_size, n)}")
    codes = unpack_awq(qweight)  # [E, K, N]
    packed = pack_gptq_qweight(codes.permute(1, 0, 2).reshape(k, e * n))  # [K/8, E*N]
    packed = packed.reshape(k // 8, e, n).permute(1, 2, 0).contiguous()  # [E, N, K/8]
    zeros = unpack_awq(qzeros).to(torch.uint8).contiguous()  # [E, K/G, N]
    return GroupedWeight("int4", packed, scales.contiguous(), zeros, group_size, n=n, k=k)


def dequantize_int4_experts(w: GroupedWeight) -> torch.Tensor:
    """GroupedWeight("int4") -> fp32 [E, N, K] (for references and checks)."""
    e, n, k8 = w.weight.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.weight.device)
    q = ((w.weight.unsqueeze(-1) >> shifts) & 0xF).reshape(e, n, k8 * 8)  # [E, N, K]
    g = torch.arange(w.k, device=q.device) // w.group_size  # [K]
    z = w.zeros.to(torch.int32).transpose(1, 2)[:, :, g]  # [E, N, K]
    s = w.scales.float().transpose(1, 2)[:, :, g]
    return (q - z).float() * s
