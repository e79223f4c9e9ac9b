"""RMSNorm, optionally with the residual add fused in front of it.

Layouts: x, residual [T, H] (any leading shape is flattened to rows), weight [H].
    s        = x + residual                (rounded to x's dtype: the new residual stream)
    out      = weight * (s * rsqrt(mean(s^2) + eps))
The normalised value is rounded to x's dtype before the weight multiply, as the Hugging Face
DeepSeek/Llama/Qwen2 RMSNorm does, so results match those modules. One program per row; the
whole row (H <= 16384) is held in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl


@triton.jit
def norm_row(s, w_ptr, out_ptr, cols, mask, hidden, eps):
    """The normalised row s [BLOCK] (activation dtype) times the weight, rounded as the reference
    module rounds it -> [BLOCK] in out's dtype."""
    s32 = s.to(tl.float32)
    var = tl.sum(s32 * s32, axis=0) / hidden
    normed = (s32 * tl.rsqrt(var + eps)).to(s.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (normed * w).to(out_ptr.dtype.element_ty)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden, eps,
                     stride_x, stride_res, stride_out, stride_res_out,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < hidden
    s = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
    tl.store(out_ptr + row * stride_out + cols, norm_row(s, w_ptr, out_ptr, cols, mask, hidden, eps), mask=mask)


def norm_launch(hidden: int, name: str) -> tuple[int, int]:
    """(BLOCK, num_warps) of a one-row-per-program norm launch over rows of `hidden`; every kernel
    that calls norm_row launches with these, so their variances sum in the same order."""
    if hidden > 16384:
        raise ValueError(f"{name} supports hidden sizes up to 16384, got {hidden}")
    block = triton.next_power_of_2(hidden)
    return block, min(16, max(1, block // 256))


def _rows(t: torch.Tensor, name: str, hidden: int) -> torch.Tensor:
    if t.shape[-1] != hidden:
        raise ValueError(f"{name} has last dimension {t.shape[-1]}, expected hidden size {hidden}")
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x, residual, weight, eps):
    hidden = weight.shape[0]
    block, warps = norm_launch(hidden, "rms_norm")
    x2 = _rows(x, "x", hidden)  # [T, H]
    out = torch.empty_like(x2)
    res2 = _rows(residual, "residual", hidden) if residual is not None else x2
    if residual is not None and res2.shape != x2.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, expected {tuple(x.shape)}")
    res_out = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out, hidden, eps,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps, **pdl.launch(x2.device))
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> weight * x / rms(x)."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H] -> (rms_norm(x + residual), x + residual)."""
    return _launch(x, residual, weight, eps)
