"""INT4 experts: repack AutoAWQ "gemm" expert tensors into the grouped GEMM's layout, at load.

AWQ per expert (stacked over E): qweight int32 [E, K, N/8] (8 nibbles along N in the order
0,2,4,6,1,3,5,7), qzeros int32 [E, K/G, N/8] (same order), scales [E, K/G, N]; W^T = (q - z) * s.
Kernel layout (moe_gemm "int4"): qweight int32 [E, N/16, K/128, 16, 16], tiled: 16 output rows x
128 input channels are one contiguous 1 KiB block, and nibble j of word i of a row holds channel
32 (j % 4) + 2i + j // 4 of the tile (the "paired" order): nibbles j and j + 4 of a
word are neighbouring channels, so one lop3 that takes both into the halves of a register gives the
bf16x2 an MMA operand register holds, and nibble planes j and j + 4 together are 32 consecutive
channels (one K = 32 MMA step on a contiguous slice of the activations); zeros uint8 [E, K/G, N];
scales [E, K/G, N] unchanged.
Needs N % 16 == 0 and K % 128 == 0 (true of DeepSeek V2/V3 expert shapes).
"""
from __future__ import annotations

import torch

from dsquant.formats.awq_gemm import unpack_awq
from dsquant.formats.gptq import pack_gptq_qweight
from dsquant.runtime.kernels.moe.moe_gemm import GroupedWeight

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
    if n % 16 or k % 128:
        raise ValueError(f"int4 experts need out_features % 16 == 0 and in_features % 128 == 0, got N={n}, K={k}")
    codes = unpack_awq(qweight).transpose(1, 2)  # [E, N, K]
    planes = codes.reshape(e, n // 16, 16, k // 128, 4, 16, 2)  # [e, chunk, r, tile, j % 4, i, j // 4]
    planes = planes.permute(6, 4, 0, 1, 3, 2, 5).reshape(8, -1)  # [j, words]
    packed = pack_gptq_qweight(planes).reshape(e, n // 16, k // 128, 16, 16)  # nibble j = plane j
    zeros = unpack_awq(qzeros).to(torch.uint8).contiguous()  # [E, K/G, N]
    return GroupedWeight("int4", packed.contiguous(), scales.contiguous(), zeros, group_size, n=n, k=k)


def dequantize_int4_experts(w: GroupedWeight) -> torch.Tensor:
    """GroupedWeight("int4") -> fp32 [E, N, K] (for references and checks)."""
    e, n, k = w.num_experts, w.n, w.k
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.weight.device)
    q = (w.weight.unsqueeze(-1) >> shifts) & 0xF  # [e, chunk, tile, r, i, j]
    q = q.reshape(e, n // 16, k // 128, 16, 16, 2, 4)  # [e, chunk, tile, r, i, j // 4, j % 4]
    q = q.permute(0, 1, 3, 2, 6, 4, 5).reshape(e, n, k)  # [e, (chunk, r), (tile, j % 4, i, j // 4)]
    g = torch.arange(k, device=q.device) // w.group_size  # [K]
    z = w.zeros.to(torch.int32).transpose(1, 2)[:, :, g]  # [E, N, K]
    s = w.scales.float().transpose(1, 2)[:, :, g]
    return (q - z).float() * s
