"""Format codecs: pack/unpack of each quantized weight layout dsquant reads and writes.

Used by both sides (export writes, runtime/models read), so this module imports nothing else of
dsquant. Conventions: a Linear has out_features N and in_features K; a dense weight is [N, K] as
in torch; "q" tensors hold unsigned integer codes in an int32/uint8 tensor.

Layouts (see ../shared/design.md):
- AWQ "gemm" (AutoAWQ): qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales [K/G, N].
  8 nibbles per int32 along N; nibble i (bits 4i..4i+3) of packed column c holds output column
  8c + AWQ_ORDER[i], AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7). W^T[k, n] = (q - z) * s.
- GPTQ v1: qweight int32 [K/8, N] packed along K (nibble i of row r is k = 8r + i), qzeros
  int32 [K/G, N/8] packed along N in plain order and stored as z - 1 (GPTQ v2, the
  `checkpoint_format: gptq_v2` of GPTQModel: stored as z), scales [K/G, N],
  g_idx int32 [K] (group of each input channel; a permutation under act-order).
- FP8 block (DeepSeek-V3): weight float8_e4m3fn [N, K], weight_scale_inv fp32
  [ceil(N/B), ceil(K/B)] with B = 128; W = fp8 * scale_inv per block, edge blocks partial.
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# column j inside a pack of 8 sits in nibble AWQ_NIBBLE_OF_COLUMN[j]
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
FP8_E4M3_MAX = 448.0
FP8_BLOCK = 128


def _shifts(device) -> torch.Tensor:
    return torch.arange(0, 32, 4, dtype=torch.int32, device=device)  # [8]


def _pack_last_dim(q: torch.Tensor, nibble_of_column) -> torch.Tensor:
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


def _unpack_last_dim(packed: torch.Tensor, nibble_of_column) -> torch.Tensor:
    """int32 [..., C/8] -> int32 [..., C] with values 0..15 (inverse of _pack_last_dim)."""
    shifts = _shifts(packed.device)[list(nibble_of_column)]  # [8]
    q = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [..., C/8, 8]
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


# ---------------------------------------------------------------- AWQ "gemm"
def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """q [R, N] codes 0..15 (R = K for qweight, K/G for qzeros) -> int32 [R, N/8] in AWQ order."""
    return _pack_last_dim(q, AWQ_NIBBLE_OF_COLUMN)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] in AWQ order -> int32 [R, N] codes 0..15."""
    return _unpack_last_dim(packed, AWQ_NIBBLE_OF_COLUMN)


def group_index(k: int, group_size: int, device=None) -> torch.Tensor:
    """g_idx [K] int64 for plain (non act-order) grouping."""
    return torch.arange(k, device=device) // group_size


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """AWQ gemm tensors -> dense weight [N, K] in `dtype`."""
    q = unpack_awq(qweight)  # [K, N]
    z = unpack_awq(qzeros)  # [K/G, N]
    k = q.shape[0]
    g = group_index(k, group_size, q.device)  # [K]
    w_t = (q - z[g]).to(torch.float32) * scales.to(torch.float32)[g]  # [K, N]
    return w_t.t().contiguous().to(dtype)


# ---------------------------------------------------------------- GPTQ v1
def pack_gptq_qweight(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] codes 0..15 -> int32 [K/8, N], packed along K in plain order."""
    k, n = q.shape
    if k % 8:
        raise ValueError(f"GPTQ packing needs K % 8 == 0, got K={k}")
    return _pack_last_dim(q.t(), range(8)).t().contiguous()


def unpack_gptq_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] -> int32 [K, N] codes 0..15."""
    return _unpack_last_dim(qweight.t(), range(8)).t().contiguous()


def pack_gptq_qzeros(z: torch.Tensor, v2: bool = False) -> torch.Tensor:
    """zero points [K/G, N] -> int32 [K/G, N/8]: v1 stores z - 1 (z in 1..16), v2 z itself (0..15).

    GPTQ v1 cannot store a zero point of 0 (it would wrap to 15 and read back as 16, another
    weight): such grids are refused; clamp z to >= 1 and re-round the codes first (calibrate/gptq.py).
    """
    z = z.to(torch.int32)
    lo, hi = (0, 15) if v2 else (1, 16)
    if z.numel() and (int(z.min()) < lo or int(z.max()) > hi):
        if v2:
            raise ValueError(f"GPTQ v2 stores zero points 0..15, got {int(z.min())}..{int(z.max())}")
        raise ValueError(f"GPTQ v1 stores zero points 1..16 (as z - 1 in 4 bits), got {int(z.min())}.."
                         f"{int(z.max())}: clamp the zero points to >= 1 and re-round the codes")
    return _pack_last_dim(z if v2 else (z - 1) & 0xF, range(8))


def unpack_gptq_qzeros(qzeros: torch.Tensor, v2: bool = False) -> torch.Tensor:
    """int32 [K/G, N/8] -> zero points [K/G, N]: the stored value + 1 (v1), or as stored (v2)."""
    return _unpack_last_dim(qzeros, range(8)) + (0 if v2 else 1)


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor, dtype: torch.dtype = torch.float32, v2: bool = False) -> torch.Tensor:
    """GPTQ tensors (v1, or v2 with `v2`) -> dense weight [N, K] in `dtype`."""
    q = unpack_gptq_qweight(qweight)  # [K, N]
    z = unpack_gptq_qzeros(qzeros, v2)  # [K/G, N]
    g = g_idx.to(torch.long)
    w_t = (q - z[g]).to(torch.float32) * scales.to(torch.float32)[g]  # [K, N]
    return w_t.t().contiguous().to(dtype)


# ---------------------------------------------------------------- integer grid
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


def to_awq_tensors(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype=torch.float16):
    """Grid codes in [N, K] / [N, K/G] layout -> AWQ gemm (qweight, qzeros, scales)."""
    return pack_awq(q.t()), pack_awq(zeros.t()), scales.t().contiguous().to(dtype)


def to_gptq_tensors(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype=torch.float16, v2: bool = False):
    """Grid codes in [N, K] / [N, K/G] layout -> GPTQ v1 (or v2) (qweight, qzeros, scales, g_idx)."""
    k = q.shape[1]
    g_idx = group_index(k, group_size, q.device).to(torch.int32)
    return (pack_gptq_qweight(q.t()), pack_gptq_qzeros(zeros.t(), v2), scales.t().contiguous().to(dtype),
            g_idx)


# ---------------------------------------------------------------- FP8 block
def fp8_block_shape(n: int, k: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    return (n + block - 1) // block, (k + block - 1) // block


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK):
    """w [N, K] -> (float8_e4m3fn [N, K], weight_scale_inv fp32 [ceil(N/B), ceil(K/B)]).

    Scale per block = absmax / 448; W ~= fp8 * scale_inv (DeepSeek-V3's layout).
    """
    n, k = w.shape
    nb, kb = fp8_block_shape(n, k, block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.to(torch.float32)
    blocks = padded.reshape(nb, block, kb, block)  # [nb, B, kb, B]
    amax = blocks.abs().amax(dim=(1, 3))  # [nb, kb]
    scale_inv = (amax / FP8_E4M3_MAX).clamp(min=1e-12)
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.reshape(nb * block, kb * block)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale_inv.contiguous()


FP8_ACT_SCALE_EPS = 1e-10


def quantize_fp8_activations(x: torch.Tensor, group: int = FP8_BLOCK):
    """x [M, K] -> (float8_e4m3fn [M, K], scale fp32 [M, ceil(K/G)]): dynamic per-token, per-G-channel.

    scale = max(amax(|x_group|), 1e-10) / 448 and x ~= fp8 * scale: DeepSeek-V3's activation
    scheme ("activation_scheme": "dynamic"), which the FP8 GEMM kernels apply to their input.
    """
    m, k = x.shape
    ng = -(-k // group)
    padded = torch.zeros(m, ng * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.to(torch.float32)
    groups = padded.view(m, ng, group)  # [M, ng, G]
    amax = groups.abs().amax(-1).clamp(min=FP8_ACT_SCALE_EPS)  # [M, ng]
    # an IEEE division, as the kernels' div_rn: dividing by a Python scalar, torch on CUDA
    # multiplies by the reciprocal instead, a last-bit difference in about 1% of the scales that
    # moves the codes of values at a rounding tie
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    q = (groups / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.view(m, -1)[:, :k].to(torch.float8_e4m3fn).contiguous(), scale


def fp8_activation_roundtrip(x: torch.Tensor, group: int = FP8_BLOCK, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] -> the values a W8A8 FP8 GEMM multiplies (fp8 * scale), in `dtype` (default x's)."""
    k = x.shape[-1]
    q, s = quantize_fp8_activations(x.reshape(-1, k), group)
    deq = q.to(torch.float32) * s.repeat_interleave(group, dim=1)[:, :k]  # [M, K]
    return deq.to(dtype or x.dtype).reshape(x.shape)


def dequantize_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                         block: int = FP8_BLOCK) -> torch.Tensor:
    """float8_e4m3fn [N, K] + scale_inv [ceil(N/B), ceil(K/B)] -> [N, K] in `dtype`."""
    n, k = w.shape
    nb, kb = fp8_block_shape(n, k, block)
    if tuple(scale_inv.shape) != (nb, kb):
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {(nb, kb)} "
                         f"for a weight of shape {(n, k)} with {block}x{block} blocks")
    s = scale_inv.to(torch.float32).repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (w.to(torch.float32) * s).to(dtype)
