"""INT4 experts: repack expert codes (AutoAWQ "gemm" tensors, or any source's unpacked codes) into
the grouped GEMM's layout, at load.

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
Act-order GPTQ experts (desc_act: each group a set of channels scattered over K) are stored with their
columns sorted by group, so groups are contiguous runs again, and perm int32 [E, K] beside them: packed
channel j of expert e is input channel perm[e, j], and every INT4 MoE kernel gathers a[:, perm[e]].
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
    if qweight.dim() != 3 or qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32 [E, K, N/8], got {qweight.dtype} {tuple(qweight.shape)}")
    e, k, n8 = qweight.shape
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 experts support group_size in {GROUP_SIZES}, got {group_size}")
    if k % group_size or k % 8:
        raise ValueError(f"in_features K={k} must be a multiple of group_size {group_size} and of 8")
    if tuple(qzeros.shape) != (e, k // group_size, n8):
        raise ValueError(f"qzeros has shape {tuple(qzeros.shape)}, expected {(e, k // group_size, n8)}")
    return int4_experts(unpack_awq(qweight).transpose(1, 2), unpack_awq(qzeros), scales, group_size)


def int4_experts(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 perm: torch.Tensor | None = None) -> GroupedWeight:
    """Unsigned grid codes [E, N, K] (0..15), zero points [E, K/G, N] (0..16: GPTQ v1 reaches 16) and
    scales [E, K/G, N] of E experts (W = (q - z) * s, from any INT4 source) -> GroupedWeight("int4").
    perm [E, K] (act-order GPTQ): column j of expert e's codes is its input channel perm[e, j]."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 experts support group_size in {GROUP_SIZES}, got {group_size}")
    if codes.dim() != 3:
        raise ValueError(f"codes must be [E, N, K], got {tuple(codes.shape)}")
    e, n, k = codes.shape
    if n % 16 or k % 128:
        raise ValueError(f"int4 experts need out_features % 16 == 0 and in_features % 128 == 0, got N={n}, K={k}")
    if tuple(zeros.shape) != (e, k // group_size, n):
        raise ValueError(f"zeros have shape {tuple(zeros.shape)}, expected {(e, k // group_size, n)}")
    if tuple(scales.shape) != (e, k // group_size, n):
        raise ValueError(f"scales have shape {tuple(scales.shape)}, expected {(e, k // group_size, n)}")
    if perm is not None and (tuple(perm.shape) != (e, k) or not torch.equal(
            perm.sort(dim=1).values, torch.arange(k, device=perm.device).expand(e, k))):
        raise ValueError(f"perm must hold a permutation of the {k} input channels for each of {e} experts, "
                         f"got shape {tuple(perm.shape)}")
    packed = torch.empty(e, n // 16, k // 128, 16, 16, dtype=torch.int32, device=codes.device)
    for x in range(e):  # one expert's int32 planes at a time (codes may come as uint8)
        planes = codes[x].to(torch.int32).reshape(n // 16, 16, k // 128, 4, 16, 2)  # [chunk, r, tile, j%4, i, j//4]
        planes = planes.permute(5, 3, 0, 2, 1, 4).reshape(8, -1)  # [j, words]
        packed[x] = pack_gptq_qweight(planes).reshape(n // 16, k // 128, 16, 16)  # nibble j = plane j
    return GroupedWeight("int4", packed, scales.contiguous(), zeros.to(torch.uint8).contiguous(),
                         group_size, n=n, k=k, perm=None if perm is None else perm.to(torch.int32).contiguous())


def dequantize_int4_experts(w: GroupedWeight) -> torch.Tensor:
    """GroupedWeight("int4") -> fp32 [E, N, K] in the input channels' order (for references and checks)."""
    e, n, k = w.num_experts, w.n, w.k
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.weight.device)
    q = (w.weight.unsqueeze(-1) >> shifts) & 0xF  # [e, chunk, tile, r, i, j]
    q = q.reshape(e, n // 16, k // 128, 16, 16, 2, 4)  # [e, chunk, tile, r, i, j // 4, j % 4]
    q = q.permute(0, 1, 3, 2, 6, 4, 5).reshape(e, n, k)  # [e, (chunk, r), (tile, j % 4, i, j // 4)]
    g = torch.arange(k, device=q.device) // w.group_size  # [K]
    z = w.zeros.to(torch.int32).transpose(1, 2)[:, :, g]  # [E, N, K]
    s = w.scales.float().transpose(1, 2)[:, :, g]
    dense = (q - z).float() * s  # [E, N, K], columns in the packed channel order
    if w.perm is None:
        return dense
    return torch.empty_like(dense).scatter_(2, w.perm.long()[:, None, :].expand_as(dense), dense)
