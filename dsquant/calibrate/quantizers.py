"""Weight quantizers on the shared grids (formats/int_grid.py, formats/fp8_block.py), and the result every method returns.

All math is in float32 on the layer's device. `QuantizedWeight.dequantized` is exactly what an
artifact reader computes from the exported tensors (scales are rounded to their export dtype
first), so the sequential forward sees the same weights inference will.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dsquant.calibrate.recipe import SchemeSpec
from dsquant.formats.fp8_block import dequantize_fp8_block, quantize_fp8_block
from dsquant.formats.int_grid import dequantize_int_groupwise, quantize_int_groupwise


@dataclass
class QuantizedWeight:
    """One Linear's quantized form. Int schemes fill q/scales/zeros (+ g_idx for GPTQ);
    fp8_block fills fp8/scale_inv; bf16 keeps `dequantized` as the weight itself."""

    spec: SchemeSpec
    dequantized: torch.Tensor | None  # [N, K] float32 (None once compact)
    q: torch.Tensor | None = None  # [N, K] int32 codes 0..15 (uint8 once compact)
    scales: torch.Tensor | None = None  # [N, K/G] in the export scale dtype
    zeros: torch.Tensor | None = None  # [N, K/G] int32
    g_idx: torch.Tensor | None = None  # [K] int32 (GPTQ; a permutation's groups under act-order)
    fp8: torch.Tensor | None = None  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor | None = None  # [ceil(N/128), ceil(K/128)] fp32

    def compact(self) -> QuantizedWeight:
        """Only what export needs, as small as it goes: int codes as uint8 and no dequantized copy
        (the calibrated layer holds it), a kept weight in bf16. A DeepSeek-V3 MoE layer's 11.3B
        weights then take 1 byte each until written instead of 8 (int32 codes + fp32 copy)."""
        if self.spec.scheme == "bf16":
            return replace(self, dequantized=self.dequantized.to(torch.bfloat16))
        q = None if self.q is None else self.q.to(torch.uint8)
        return replace(self, dequantized=None, q=q)


def int_grid(w: torch.Tensor, spec: SchemeSpec, scale_dtype: torch.dtype, symmetric: bool = False,
             clip_ratio: torch.Tensor | float = 1.0) -> QuantizedWeight:
    """Round-to-nearest onto the group grid; w [N, K] float32."""
    _, scales, zeros = quantize_int_groupwise(w, spec.group_size, spec.bits, symmetric, clip_ratio)
    scales = scales.to(scale_dtype).to(torch.float32).clamp(min=torch.finfo(scale_dtype).tiny)
    q = codes_for(w, scales, zeros, spec)
    deq = dequantize_int_groupwise(q, scales, zeros, spec.group_size)
    return QuantizedWeight(spec, deq, q=q, scales=scales.to(scale_dtype), zeros=zeros)


def rescale_rows(qw: QuantizedWeight, s: torch.Tensor, scale_dtype: torch.dtype) -> QuantizedWeight:
    """An INT weight with output row n divided by s[n] (s [N]: a later AWQ fold into this Linear as
    producer): codes and zero points kept, scales [N, K/G] divided and rounded to scale_dtype, as
    int_grid rounds them; `dequantized` recomputed from them."""
    scales = (qw.scales.to(torch.float32) / s.to(torch.float32)[:, None]).to(scale_dtype).to(torch.float32)
    scales = scales.clamp(min=torch.finfo(scale_dtype).tiny)
    deq = dequantize_int_groupwise(qw.q.to(torch.int32), scales, qw.zeros, qw.spec.group_size)
    return replace(qw, dequantized=deq, scales=scales.to(scale_dtype))


def codes_for(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, spec: SchemeSpec) -> torch.Tensor:
    """Codes of w [N, K] for given (already rounded) scales/zeros [N, K/G]."""
    n, k = w.shape
    g = spec.group_size
    qmax = 2 ** spec.bits - 1
    wg = w.reshape(n, k // g, g)
    q = torch.round(wg / scales.unsqueeze(-1)) + zeros.unsqueeze(-1)
    return q.clamp(0, qmax).to(torch.int32).reshape(n, k)


def fake_int(w: torch.Tensor, spec: SchemeSpec, scale_dtype: torch.dtype,
             clip_ratio: torch.Tensor | float = 1.0) -> torch.Tensor:
    """int_grid(w, ...).dequantized, bitwise, for the searches (which call it thousands of times a
    layer): w [N, K] float32 (rows may be several experts' stacked) -> [N, K] float32.

    Five passes over w instead of about seventeen: one min/max reduction per group, then the
    codes never leave float: (clamp(round(w / s) + z, 0, qmax) - z) * s is computed as
    clamp(round(w / s), -z, qmax - z) * s, equal for integer-valued floats below 2^24 and both
    clamped beyond."""
    n, k = w.shape
    g = spec.group_size
    if k % g:
        raise ValueError(f"group_size {g} does not divide in_features {k}")
    qmax = 2 ** spec.bits - 1
    wg = w.to(torch.float32).reshape(n, k // g, g)  # [N, K/G, G]
    wmin, wmax = torch.aminmax(wg, dim=-1)  # [N, K/G]
    ratio = clip_ratio if isinstance(clip_ratio, float) else clip_ratio.to(torch.float32)
    bound = torch.maximum(wmax.abs(), wmin.abs()) * ratio  # the group's absmax, clipped
    wmax = torch.minimum(wmax.clamp(min=0), bound)
    wmin = torch.maximum(wmin.clamp(max=0), -bound)
    scales = ((wmax - wmin) / qmax).clamp(min=1e-8)
    zeros = torch.round(-wmin / scales).clamp(0, qmax).unsqueeze(-1)  # [N, K/G, 1], from the unrounded scale
    rounded = scales.to(scale_dtype).to(torch.float32).clamp(min=torch.finfo(scale_dtype).tiny).unsqueeze(-1)
    out = torch.div(wg, rounded).round_()
    out = torch.clamp(out, -zeros, qmax - zeros, out=out).mul_(rounded)
    return out.reshape(n, k)


def fp8_block(w: torch.Tensor, spec: SchemeSpec) -> QuantizedWeight:
    fp8, scale_inv = quantize_fp8_block(w)
    return QuantizedWeight(spec, dequantize_fp8_block(fp8, scale_inv), fp8=fp8, scale_inv=scale_inv)


def fake_quant(w: torch.Tensor, spec: SchemeSpec, scale_dtype: torch.dtype) -> torch.Tensor:
    """What `spec` does to w, dequantized (used inside AWQ's scale search)."""
    if spec.is_int:
        return fake_int(w, spec, scale_dtype)
    if spec.scheme == "fp8_block":
        return fp8_block(w, spec).dequantized
    return w


def relative_output_error(x: torch.Tensor, w: torch.Tensor, w_q: torch.Tensor) -> float:
    """||x (w_q - w)^T|| / ||x w^T|| on captured inputs x [T, K]; weight error if no inputs."""
    if x is None or x.numel() == 0:
        return float((w_q - w).norm() / w.norm().clamp(min=1e-12))
    ref = x @ w.t()
    return float((x @ (w_q - w).t()).norm() / ref.norm().clamp(min=1e-12))
