"""W4A16 weights in the kernel layout: repacking AutoAWQ "gemm" and GPTQ v1 tensors at load time.

Kernel layout (`W4A16Weights`), for a Linear with out_features N, in_features K, group size G:
    qweight  int32 [N, K/8]   packed along K, in one of two code orders (`sliced`):
             paired (K % 128 == 0 and G in 32, 64, 128, see `slice_codes`; the attribute keeps its
             old name): word 16c + i holds in nibble j the code of k = 128c + 32 (j % 4) + 2i + j // 4,
             so nibbles j and j + 4 of a word are neighbouring channels, the two halves of one MMA
             operand register after one lop3 (int4_paired.py; MoE experts use the same order);
             plain (any other shape): nibble i (bits 4i..4i+3) of word c holds k = 8c + i
    scales   fp16/bf16 [K/G, N]  (kept in the checkpoint's dtype; the kernel multiplies in fp32)
    zeros    uint8 [K/G, N]   zero-point codes 0..16
    perm     int32 [K] or None: GPTQ act-order; the kernel reads activation column perm[j] for
             packed row j, so W'[:, j] = W[:, perm[j]] and groups are contiguous (j // G)
    W[n, k'] = (q[n, j] - zeros[j // G, n]) * scales[j // G, n]  with k' = perm[j] (or j)

Row-major along K puts each output channel's codes in one contiguous run, which is what every
kernel streams. Pure torch; no Triton here, so the CPU
runtime path (`w4a16_linear_reference`) works without the interpreter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsquant.formats.awq_gemm import unpack_awq
from dsquant.formats.gptq import act_order_perm, pack_gptq_qweight, unpack_gptq_qweight, unpack_gptq_qzeros
from dsquant.runtime.kernels.gemm.splitk import new_splitk_counters


@dataclass
class W4A16Weights:
    qweight: torch.Tensor  # int32 [N, K/8]
    scales: torch.Tensor  # fp16/bf16 [K/G, N]
    zeros: torch.Tensor  # uint8 [K/G, N]
    group_size: int
    perm: torch.Tensor | None = None  # int32 [K] (act-order) or None
    splitk_counters: torch.Tensor | None = None  # int32 [>= tiles], zero; reset by the kernel
    sliced: bool = False  # qweight in the paired code order (module docstring; named for the order before it)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 8

    def nbytes(self) -> int:
        """Bytes the kernel reads per call (codes + scales + zeros + perm)."""
        ts = [self.qweight, self.scales, self.zeros] + ([self.perm] if self.perm is not None else [])
        return sum(t.numel() * t.element_size() for t in ts)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


SLICED_GROUPS = (32, 64, 128)


def slice_codes(q_nk: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15, K % 128 == 0) -> int32 [N, K/8] in the paired order (int4_paired.py): word
    16c + i of row n holds, in nibble j, the code of k = 128c + 32 (j % 4) + 2i + j // 4."""
    n, k = q_nk.shape
    _check(k % 128 == 0, f"the paired code order needs in_features % 128 == 0, got {k}")
    q = q_nk.to(torch.int32).reshape(n, k // 128, 4, 16, 2)  # [N, chunk, j % 4, i, j // 4]
    words = torch.zeros(n, k // 128, 16, dtype=torch.int32, device=q_nk.device)
    for j in range(8):
        words |= q[:, :, j % 4, :, j // 4] << (4 * j)
    return words.reshape(n, k // 8).contiguous()


def unslice_codes(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of slice_codes: int32 [N, K/8] -> codes int32 [N, K]."""
    n, kw = qweight.shape
    words = qweight.reshape(n, kw // 16, 1, 16)  # [N, chunk, 1, i]
    shifts = (torch.arange(8, device=qweight.device, dtype=torch.int32) * 4).view(1, 1, 8, 1)
    q = (words >> shifts) & 0xF  # [N, chunk, j, i], j = 4 (j // 4) + j % 4
    return q.reshape(n, kw // 16, 2, 4, 16).permute(0, 1, 3, 4, 2).reshape(n, kw * 8)


def uses_sliced_order(in_features: int, group_size: int) -> bool:
    return in_features % 128 == 0 and group_size in SLICED_GROUPS


def kernel_weights(q_kn: torch.Tensor, z_gn: torch.Tensor, scales: torch.Tensor, group_size: int,
                   perm: torch.Tensor | None = None) -> W4A16Weights:
    """Codes [K, N] (kernel K order), zero points [K/G, N], scales [K/G, N] -> W4A16Weights, in the
    paired order where the shape allows it, else the plain one."""
    k = q_kn.shape[0]
    sliced = uses_sliced_order(k, group_size)
    qweight = slice_codes(q_kn.t()) if sliced else pack_gptq_qweight(q_kn).t().contiguous()
    counters = new_splitk_counters(q_kn.device)
    return W4A16Weights(qweight=qweight, scales=scales.contiguous(), zeros=z_gn.to(torch.uint8).contiguous(),
                        group_size=group_size, perm=perm, splitk_counters=counters, sliced=sliced)


def codes_nk(w: W4A16Weights) -> torch.Tensor:
    """The codes of `w` as int32 [N, K] in the kernel's K order, whichever code order it holds."""
    if w.sliced:
        return unslice_codes(w.qweight)
    return unpack_gptq_qweight(w.qweight.t().contiguous()).t()


def repack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> W4A16Weights:
    """AutoAWQ "gemm" tensors (qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]) -> kernel layout."""
    _check(qweight.dtype == torch.int32 and qweight.dim() == 2,
           f"qweight must be int32 [K, N/8], got {qweight.dtype} {tuple(qweight.shape)}")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    _check(group_size in (32, 64, 128) or (group_size > 0 and k % group_size == 0 and group_size % 32 == 0),
           f"group_size must be 32, 64 or 128 (or a multiple of 32 dividing K={k}), got {group_size}")
    _check(k % group_size == 0, f"group_size {group_size} does not divide in_features K={k}")
    ng = k // group_size
    _check(tuple(qzeros.shape) == (ng, n // 8),
           f"qzeros has shape {tuple(qzeros.shape)}, expected {(ng, n // 8)} for qweight {tuple(qweight.shape)}")
    _check(tuple(scales.shape) == (ng, n),
           f"scales has shape {tuple(scales.shape)}, expected {(ng, n)} for qweight {tuple(qweight.shape)}")
    q = unpack_awq(qweight)  # [K, N]
    z = unpack_awq(qzeros)  # [K/G, N]
    return kernel_weights(q, z, scales, group_size)


def repack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None = None, v2: bool = False) -> W4A16Weights:
    """GPTQ v1 tensors (qweight [K/8, N], qzeros [K/G, N/8] as z-1, scales [K/G, N], g_idx [K]);
    v2: qzeros hold z itself (checkpoint_format gptq_v2).

    Act-order (`desc_act`) g_idx is turned into a permutation of K at load: rows are sorted by
    group so each group is a contiguous run of G rows, and the kernel gathers x[:, perm].
    """
    _check(qweight.dtype == torch.int32 and qweight.dim() == 2,
           f"qweight must be int32 [K/8, N], got {qweight.dtype} {tuple(qweight.shape)}")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    ng = scales.shape[0]
    _check(scales.dim() == 2 and scales.shape[1] == n and ng > 0 and k % ng == 0,
           f"scales has shape {tuple(scales.shape)}, expected [K/G, {n}] with K={k}")
    group_size = k // ng
    _check(tuple(qzeros.shape) == (ng, n // 8),
           f"qzeros has shape {tuple(qzeros.shape)}, expected {(ng, n // 8)}")
    q = unpack_gptq_qweight(qweight)  # [K, N]
    z = unpack_gptq_qzeros(qzeros, v2)  # [K/G, N], values 1..16 (v1) or 0..15 (v2)
    perm = None
    if g_idx is not None:
        _check(tuple(g_idx.shape) == (k,), f"g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
        order = act_order_perm(g_idx, ng)  # [K] or None; a ValueError for uneven groups
        if order is not None:
            perm = order.to(torch.int32).contiguous()
            q = q[order]
    return kernel_weights(q, z, scales, group_size, perm)


def dequantize_w4a16(w: W4A16Weights, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Kernel layout -> dense [N, K] in the kernel's K order (apply x[:, perm] before using it)."""
    k = w.in_features
    q = codes_nk(w)  # [N, K]
    g = torch.arange(k, device=q.device) // w.group_size  # [K]
    z = w.zeros.to(torch.float32).t()[:, g]  # [N, K]
    s = w.scales.to(torch.float32).t()[:, g]  # [N, K]
    return ((q.to(torch.float32) - z) * s).to(dtype)


def w4a16_linear_reference(x: torch.Tensor, w: W4A16Weights,
                           compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure-torch y = x @ W^T (x [..., K]) -> [..., N] in x's dtype: the CPU path and the test oracle."""
    k = w.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x has last dimension {x.shape[-1]}, expected in_features {k}")
    x2 = x.reshape(-1, k)
    if w.perm is not None:
        x2 = x2[:, w.perm.long()]
    y = x2.to(compute_dtype) @ dequantize_w4a16(w, compute_dtype).t()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)
