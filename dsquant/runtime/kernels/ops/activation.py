"""SiLU-and-mul: the SwiGLU activation of a gate/up projection pair.

Layouts: either x [T, 2I] holding the gate projection in columns [0, I) and the up projection in
[I, 2I) (the order of a stacked `gate_up_proj`), or gate [T, I] and up [T, I] as two tensors
(row strides free, unit column stride); out [T, I] = silu(gate) * up, computed in fp32.
silu_and_mul rounds once, to x's dtype; silu_mul rounds silu(gate) to the dtype before the
multiply, as torch's `F.silu(gate) * up` does, so it matches the reference MLP bit for bit up to
the exp implementation. One program per (row, block of I columns).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl


@triton.jit
def silu_mul_as_reference(gate, up, DTYPE: tl.constexpr):
    """fp32 gate/up accumulators -> silu(gate) * up rounded as the reference MLP rounds: each
    projection's output to DTYPE, silu computed in fp32 and rounded to DTYPE, the product in fp32
    (the caller rounds it on store). For GEMM epilogues that fuse the activation: before a W8A8
    down projection re-quantizes it, a last-bit difference here can move an fp8 code."""
    g = gate.to(DTYPE).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
    return act * up.to(DTYPE).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, inter, stride_gate, stride_up, stride_out,
                         BLOCK: tl.constexpr, ROUND_SILU: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate))
    if ROUND_SILU:
        act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(gate, up, out, round_silu: bool) -> torch.Tensor:
    t, inter = gate.shape
    if out is None:
        out = torch.empty(t, inter, dtype=gate.dtype, device=gate.device)
    elif out.shape != (t, inter) or out.stride(1) != 1:
        raise ValueError(f"out must be [T={t}, I={inter}] with unit column stride, got {tuple(out.shape)}")
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
        gate, up, out, inter, gate.stride(0), up.stride(0), out.stride(0), BLOCK=block, ROUND_SILU=round_silu,
        **pdl.launch(out.device))
    return out


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> out [T, I] = silu(gate) * up."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul expects x of shape [T, 2I], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError("silu_and_mul expects x contiguous along its last dimension")
    inter = x.shape[1] // 2
    return _launch(x[:, :inter], x[:, inter:], out, round_silu=False)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate, up [..., I] -> out [..., I] = silu(gate) * up, silu rounded to the dtype (as torch)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must share shape and dtype, got {gate.dtype} {tuple(gate.shape)} "
                         f"and {up.dtype} {tuple(up.shape)}")
    if gate.dim() == 0 or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("silu_mul expects gate and up contiguous along their last dimension")
    inter = gate.shape[-1]
    g2, u2 = gate.reshape(-1, inter), up.reshape(-1, inter)  # [T, I]
    out2 = None if out is None else out.view(-1, inter)
    return _launch(g2, u2, out2, round_silu=True).view(gate.shape)
