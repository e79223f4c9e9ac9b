"""SiLU-and-mul: the SwiGLU activation of a gate/up projection pair.

Layout: x [T, 2I] holds the gate projection in columns [0, I) and the up projection in
[I, 2I) (the order of a stacked `gate_up_proj`); out [T, I] = silu(gate) * up, computed in fp32
and rounded once to x's dtype. One program per (row, block of I columns).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> out [T, I] = silu(gate) * up."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul expects x of shape [T, 2I], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError("silu_and_mul expects x contiguous along its last dimension")
    t, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(t, inter, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), out.stride(0), BLOCK=block)
    return out
