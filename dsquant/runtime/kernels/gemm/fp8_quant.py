"""Dynamic FP8 activation quantization, per token and per group of 128 channels (DeepSeek-V3).

x [M, K] bf16/fp16 -> x_fp8 float8_e4m3fn [M, K], x_scale fp32 [M, ceil(K/G)], with
    scale[m, j] = max(amax(|x[m, jG:(j+1)G]|), EPS) / 448,  x_fp8 = clamp(x / scale, +-448)
so x ~= x_fp8 * scale. The last group may be partial (K % G != 0). The scales come row-major
([M, ceil(K/G)] contiguous) or column-major (stride 1 along M, what cuBLAS's blockwise
`torch._scaled_mm` wants). `quant_group_fp8` is the same arithmetic as a `triton.jit` helper,
which fp8_gemm.py calls to quantize a decode batch inside the GEMM.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl

FP8_MAX = 448.0
SCALE_EPS = 1e-10


@triton.jit
def quant_group_fp8(x, AXIS: tl.constexpr):
    """x fp32 tile -> (fp8 e4m3 tile, fp32 scales reduced over AXIS)."""
    amax = tl.max(tl.abs(x), axis=AXIS)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-10), 448.0)  # IEEE division, as fp8_block.quantize_fp8_activations
    q = tl.clamp(tl.math.div_rn(x, tl.expand_dims(scale, AXIS)), -448.0, 448.0).to(tl.float8e4nv)
    return q, scale


@triton.jit
def _per_token_group_quant_kernel(x_ptr, q_ptr, s_ptr, K, num_groups, stride_xm, stride_qm,
                                  stride_sm, stride_sg, GROUP: tl.constexpr,
                                  GROUPS_PER_PROG: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    m = tl.program_id(0)
    offs_g = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)  # [GP]
    offs_k = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GP, G]
    mask = offs_k < K
    x = tl.load(x_ptr + m * stride_xm + offs_k, mask=mask, other=0.0).to(tl.float32)
    q, scale = quant_group_fp8(x, 1)  # [GP, G], [GP]
    tl.store(q_ptr + m * stride_qm + offs_k, q, mask=mask)
    tl.store(s_ptr + m * stride_sm + offs_g * stride_sg, scale, mask=offs_g < num_groups)


def per_token_group_quant_fp8(x: torch.Tensor, group: int = 128, column_major_scales: bool = False,
                              rows_multiple: int = 1):
    """x [..., K] -> (x_fp8 [Mp, K] float8_e4m3fn, x_scale fp32 [Mp, ceil(K/group)]), M = prod(...).

    Mp = M rounded up to `rows_multiple` (what cuBLAS's blockwise scales may ask for); the
    Mp - M padding rows are zero codes with zero scales.
    """
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"per_token_group_quant_fp8: x must be bf16/fp16/fp32, got {x.dtype}")
    if group & (group - 1) or group < 16:
        raise ValueError(f"per_token_group_quant_fp8: group must be a power of two >= 16, got {group}")
    if rows_multiple < 1:
        raise ValueError(f"per_token_group_quant_fp8: rows_multiple must be >= 1, got {rows_multiple}")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    ng = triton.cdiv(k, group)
    mp = -(-m // rows_multiple) * rows_multiple
    q = torch.empty(mp, k, dtype=torch.float8_e4m3fn, device=x.device)
    if column_major_scales:
        s = torch.empty(ng, mp, dtype=torch.float32, device=x.device).t()  # [Mp, ng], stride (1, Mp)
    else:
        s = torch.empty(mp, ng, dtype=torch.float32, device=x.device)
    if mp > m:
        q[m:].view(torch.uint8).zero_()
        s[m:].zero_()
    if m == 0:
        return q, s
    gpp = min(triton.next_power_of_2(ng), max(1, 1024 // group))
    grid = (m, triton.cdiv(ng, gpp))
    _per_token_group_quant_kernel[grid](x2, q, s, k, ng, x2.stride(0), q.stride(0), s.stride(0),
                                        s.stride(1), GROUP=group, GROUPS_PER_PROG=gpp, num_warps=4,
                                        **pdl.launch(x2.device))
    return q, s


def per_token_group_quant_fp8_reference(x: torch.Tensor, group: int = 128):
    """Pure-torch twin of per_token_group_quant_fp8 (same formula, torch's fp8 rounding)."""
    from dsquant.formats.fp8_block import quantize_fp8_activations

    return quantize_fp8_activations(x.reshape(-1, x.shape[-1]), group)
