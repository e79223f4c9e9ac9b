"""RMSNorm, optionally with the residual add fused in front of it.

Layouts: x, residual [T, H] (any leading shape is flattened to rows), weight [H].
    s        = x + residual                (rounded to x's dtype: the new residual stream)
    out      = weight * (s * rsqrt(mean(s^2) + eps))
The normalised value is rounded to x's dtype before the weight multiply, as the Hugging Face
DeepSeek/Llama/Qwen2 RMSNorm does, so results match those modules. One program per row; the
whole row (H <= 16384) is held in registers. With quant (a GPU, H % 128 == 0) the output is also
quantized per token and 128 channels for an FP8 consumer, bitwise as fp8_quant.per_token_group_quant_fp8
quantizes the stored values: codes float8_e4m3fn [Tp, H] and fp32 scales [Tp, H/128] in
fp8_quant.act_layout's layout, attached to the output (fp8_quant.attach), so that consumer skips its
quantization launch.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.gemm import fp8_quant
from dsquant.runtime.kernels.gemm.fp8_quant import quant_group_fp8


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
def store_row_fp8(y, q_ptr, qs_ptr, row, cols, mask, hidden, stride_q, stride_qsm, stride_qsg,
                  BLOCK: tl.constexpr):
    """Row y [BLOCK]'s codes and per-128 scales (fp8_quant.per_token_group_quant_fp8's arithmetic)."""
    q, scale = quant_group_fp8(tl.reshape(y.to(tl.float32), [BLOCK // 128, 128]), 1)
    tl.store(q_ptr + row * stride_q + tl.reshape(cols, [BLOCK // 128, 128]), q,
             mask=tl.reshape(mask, [BLOCK // 128, 128]))
    g = tl.arange(0, BLOCK // 128)
    tl.store(qs_ptr + row * stride_qsm + g * stride_qsg, scale, mask=g * 128 < hidden)


@triton.jit
def store_zero_fp8(q_ptr, qs_ptr, row, cols, mask, hidden, stride_q, stride_qsm, stride_qsg,
                   BLOCK: tl.constexpr):
    """A padding row of the FP8 codes: zero codes, zero scales."""
    tl.store(q_ptr + row * stride_q + cols, tl.zeros([BLOCK], dtype=tl.float32).to(q_ptr.dtype.element_ty),
             mask=mask)
    g = tl.arange(0, BLOCK // 128)
    tl.store(qs_ptr + row * stride_qsm + g * stride_qsg, tl.zeros([BLOCK // 128], dtype=tl.float32),
             mask=g * 128 < hidden)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, qs_ptr, rows, hidden, eps,
                     stride_x, stride_res, stride_out, stride_res_out, stride_q, stride_qsm, stride_qsg,
                     HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Grid (rows, or rows padded to the FP8 scales' row multiple under QUANT): padding rows only
    write zero codes and scales."""
    pdl.enter(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < hidden
    if row < rows:
        s = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
        y = norm_row(s, w_ptr, out_ptr, cols, mask, hidden, eps)
        tl.store(out_ptr + row * stride_out + cols, y, mask=mask)
        if QUANT:  # the stored values, per 128 channels: fp8_quant.per_token_group_quant_fp8's codes
            store_row_fp8(y, q_ptr, qs_ptr, row, cols, mask, hidden, stride_q, stride_qsm, stride_qsg, BLOCK)
    elif QUANT:
        store_zero_fp8(q_ptr, qs_ptr, row, cols, mask, hidden, stride_q, stride_qsm, stride_qsg, BLOCK)


def norm_warps(block: int) -> int:
    """Warps of a one-row-per-program norm launch (the variance's summation order follows them)."""
    return min(16, max(1, block // 256))


def _rows(t: torch.Tensor, name: str, hidden: int) -> torch.Tensor:
    if t.shape[-1] != hidden:
        raise ValueError(f"{name} has last dimension {t.shape[-1]}, expected hidden size {hidden}")
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def quant_takes(hidden: int, device) -> bool:
    """Whether rms_norm can quantize its output for FP8 consumers (`quant=True`): on a GPU (the
    interpreter's fp8 casts are wrong), whole 128-channel groups."""
    return hidden % 128 == 0 and hidden <= 16384 and torch.device(device).type == "cuda" and \
        os.environ.get("TRITON_INTERPRET") != "1"


def _launch(x, residual, weight, eps, quant: bool = False):
    hidden = weight.shape[0]
    if hidden > 16384:
        raise ValueError(f"rms_norm supports hidden sizes up to 16384, got {hidden}")
    x2 = _rows(x, "x", hidden)  # [T, H]
    out = torch.empty_like(x2)
    res2 = _rows(residual, "residual", hidden) if residual is not None else x2
    if residual is not None and res2.shape != x2.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, expected {tuple(x.shape)}")
    res_out = torch.empty_like(x2) if residual is not None else out
    t = x2.shape[0]
    quant = quant and t > 0 and quant_takes(hidden, x2.device)
    act = fp8_quant.act_buffers(t, hidden, x2.device) if quant else None
    q, qs = (act.q, act.scale) if quant else (out, out)
    if t:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(q.shape[0] if quant else t,)](
            x2, res2, weight, out, res_out, q, qs, t, hidden, eps,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0), q.stride(0), qs.stride(0),
            qs.stride(1) if quant else 0, HAS_RESIDUAL=residual is not None, QUANT=quant, BLOCK=block,
            num_warps=norm_warps(block), **pdl.launch(x2.device))
    out = out.view(x.shape)
    if act is not None:
        fp8_quant.attach(out, act)
    return out, res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quant: bool = False) -> torch.Tensor:
    """x [..., H], weight [H] -> weight * x / rms(x). quant: also quantize the output per token and
    128 channels for FP8 consumers (fp8_quant.attach; on a GPU, H % 128 == 0, else nothing)."""
    return _launch(x, None, weight, eps, quant)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, quant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H] -> (rms_norm(x + residual), x + residual); quant as rms_norm's."""
    return _launch(x, residual, weight, eps, quant)
