"""The integer group grid every INT4 format stores, and the nibble packing they share.

Grid: w [N, K] -> codes q int32 [N, K] in 0..2^bits-1, scales fp32 [N, K/G], zeros int32
[N, K/G]; W[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G].
Packing: 8 codes of 4 bits per int32 along the last dimension; column j of each 8 goes to the
nibble (bits 4i..4i+3) given by the format's order (AWQ's interleave, or plain for GPTQ and
compressed-tensors).
"""
from __future__ import annotations

import torch


def _shifts(device) -> torch.Tensor:
    return torch.arange(0, 32, 4, dtype=torch.int32, device=device)  # [8]


def pack_last_dim(q: torch.Tensor, nibble_of_column) -> torch.Tensor:
    """q [..., C] (values 0..15) -> int32 [..., C/8]; column j of each 8 goes to nibble_of_column[j]."""
    if q.shape[-1] % 8:
        raise ValueError(f"packing needs a multiple of 8 columns, got {q.shape[-1]}")
    q = q.to(torch.int32).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)  # [..., C/8, 8]
    shifts = _shifts(q.device)[list(nibble_of_column)]  # [8]
    parts = (q & 0xF) << shifts
    packed = parts[..., 0]
    for j in range(1, 8):
        packed = packed | parts[..., j]
    return packed.contiguous()


def unpack_last_dim(packed: torch.Tensor, nibble_of_column) -> torch.Tensor:
    """int32 [..., C/8] -> int32 [..., C] with values 0..15 (inverse of pack_last_dim)."""
    shifts = _shifts(packed.device)[list(nibble_of_column)]  # [8]
    q = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [..., C/8, 8]
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def group_index(k: int, group_size: int, device=None) -> torch.Tensor:
    """g_idx [K] int64 for plain (non act-order) grouping."""
    return torch.arange(k, device=device) // group_size


def quantize_int_groupwise(w: torch.Tensor, group_size: int, bits: int = 4, symmetric: bool = False,
                           clip_ratio: torch.Tensor | float = 1.0):
    """Round-to-nearest onto the group grid.

    w [N, K] -> (q int32 [N, K] codes in 0..2^bits-1, scales fp32 [N, K/G], zeros int32 [N, K/G]).
    Asymmetric: scale = (max - min) / (2^b - 1), zero = round(-min / scale). Symmetric (as GPTQ
    does it): zero = 2^(b-1), scale = 2 * absmax / (2^b - 1).
    `clip_ratio` (scalar or [N, K/G]) clamps each group to +-absmax * ratio before the scale is
    computed (AWQ's clip search).
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    qmax = 2 ** bits - 1
    wg = w.to(torch.float32).reshape(n, k // group_size, group_size)  # [N, K/G, G]
    ratio = clip_ratio if isinstance(clip_ratio, float) else clip_ratio.to(torch.float32)
    if symmetric:
        amax = wg.abs().amax(-1) * ratio  # [N, K/G]
        scales = (amax * 2 / qmax).clamp(min=1e-8)
        zeros = torch.full_like(scales, (qmax + 1) // 2, dtype=torch.int32)
    else:
        # clip as AWQ does: clamp the group to +-absmax * ratio, so only the wider side shrinks
        bound = wg.abs().amax(-1) * ratio
        wmax = torch.minimum(wg.amax(-1).clamp(min=0), bound)
        wmin = torch.maximum(wg.amin(-1).clamp(max=0), -bound)
        scales = ((wmax - wmin) / qmax).clamp(min=1e-8)
        zeros = torch.round(-wmin / scales).clamp(0, qmax).to(torch.int32)
    q = torch.round(wg / scales.unsqueeze(-1)) + zeros.unsqueeze(-1)
    q = q.clamp(0, qmax).to(torch.int32).reshape(n, k)
    return q, scales, zeros


def dequantize_int_groupwise(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                             group_size: int) -> torch.Tensor:
    """Inverse of quantize_int_groupwise: q [N, K], scales/zeros [N, K/G] -> fp32 [N, K]."""
    n, k = q.shape
    qg = q.reshape(n, k // group_size, group_size).to(torch.float32)
    return ((qg - zeros.unsqueeze(-1)) * scales.unsqueeze(-1)).reshape(n, k)
