"""The end of a MoE layer in one launch: weighted sum of the expert outputs, shared experts and the
residual add.

    pieces [T, P, H] (unweighted expert outputs, activation dtype, unit stride along H),
    weights fp32 [T, P], shared [T, H] or None, residual [T, H] or None  ->  out [T, H]
The P = top_k + n_shared columns are the routed experts, then n_shared shared experts run as
always-selected experts (fused_moe.with_shared_experts; their weights are 1). Rounding follows the
reference model (models/moe.py LoopMoE, MoE.forward, DecoderLayer) step by step, in fp32 between
roundings to the activation dtype, written rnd():
    routed = rnd(sum_{j < top_k} weights[t, j] * pieces[t, j])
    mlp    = rnd(routed + rnd(sum_{j >= top_k} pieces[t, j]))  if n_shared
             rnd(routed + shared[t])                           if shared is given
    out    = rnd(residual[t] + mlp)                            if residual is given
(Only a folded shared MLP differs from the reference by construction: its n pieces are each rounded
before they are summed, where the dense MLP rounds once.) A routed piece of weight 0 is not read, so
it may hold anything (fused_moe leaves the pieces of pairs with a negative expert id unwritten). One
program per (token, BLOCK_H columns).

moe_sum_rms_norm runs the same sum and then rmsnorm.py's norm of the result in one launch, one program
per token: the next decoder layer's input norm, so a MoE layer's end costs one launch, not two
(layers/fused.py defers the sum into it; MoESumInputs carries the arguments).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.ops.rmsnorm import norm_launch, norm_row


@triton.jit
def mlp_sum(pieces_ptr, weights_ptr, shared_ptr, res_ptr, t, cols, mask, top_k, stride_pt, stride_pp,
            stride_wt, stride_st, stride_rt, dtype, N_SHARED: tl.constexpr, HAS_SHARED: tl.constexpr,
            HAS_RESIDUAL: tl.constexpr):
    """Token t's output at cols [BLOCK] (fp32, its value rounded to dtype): the docstring's sum."""
    row = pieces_ptr + t * stride_pt + cols
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for j in range(0, top_k):
        w = tl.load(weights_ptr + t * stride_wt + j)
        if w != 0.0:  # a weight-0 pair adds nothing, and its piece may be unwritten (expert parallelism)
            acc += tl.load(row + j * stride_pp, mask=mask, other=0.0).to(tl.float32) * w
    mlp = acc.to(dtype).to(tl.float32)
    if N_SHARED > 0:
        sh = tl.zeros(cols.shape, dtype=tl.float32)
        for j in tl.static_range(N_SHARED):
            sh += tl.load(row + (top_k + j) * stride_pp, mask=mask, other=0.0).to(tl.float32)
        mlp = (mlp + sh.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    if HAS_SHARED:
        sh = tl.load(shared_ptr + t * stride_st + cols, mask=mask, other=0.0).to(tl.float32)
        mlp = (mlp + sh).to(dtype).to(tl.float32)
    if HAS_RESIDUAL:
        mlp = tl.load(res_ptr + t * stride_rt + cols, mask=mask, other=0.0).to(tl.float32) + mlp
    return mlp


@triton.jit
def _moe_sum_kernel(pieces_ptr, weights_ptr, shared_ptr, res_ptr, out_ptr, hidden, top_k,
                    stride_pt, stride_pp, stride_wt, stride_st, stride_rt, stride_ot,
                    N_SHARED: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    mlp = mlp_sum(pieces_ptr, weights_ptr, shared_ptr, res_ptr, t, cols, mask, top_k, stride_pt, stride_pp,
                  stride_wt, stride_st, stride_rt, dtype, N_SHARED, HAS_SHARED, HAS_RESIDUAL)
    tl.store(out_ptr + t * stride_ot + cols, mlp.to(dtype), mask=mask)


@triton.jit
def _moe_sum_rms_norm_kernel(pieces_ptr, weights_ptr, shared_ptr, res_ptr, out_ptr, w_ptr, normed_ptr,
                             hidden, top_k, eps, stride_pt, stride_pp, stride_wt, stride_st, stride_rt,
                             stride_ot, stride_nt, N_SHARED: tl.constexpr, HAS_SHARED: tl.constexpr,
                             HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """moe_sum's row, then rmsnorm.py's norm of it: one program per token."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    s = mlp_sum(pieces_ptr, weights_ptr, shared_ptr, res_ptr, t, cols, mask, top_k, stride_pt, stride_pp,
                stride_wt, stride_st, stride_rt, dtype, N_SHARED, HAS_SHARED, HAS_RESIDUAL).to(dtype)
    tl.store(out_ptr + t * stride_ot + cols, s, mask=mask)
    tl.store(normed_ptr + t * stride_nt + cols, norm_row(s, w_ptr, normed_ptr, cols, mask, hidden, eps), mask=mask)


def _rows(x: torch.Tensor | None, name: str, t: int, h: int) -> torch.Tensor | None:
    if x is None:
        return None
    if tuple(x.shape) != (t, h):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected [T={t}, H={h}]")
    return x if x.stride(1) == 1 else x.contiguous()


def _check(pieces, weights, n_shared, shared, residual):
    if pieces.dim() != 3 or pieces.stride(2) != 1:
        raise ValueError(f"pieces must be [T, P, H] with unit stride along H, got {tuple(pieces.shape)}")
    t, p, h = pieces.shape
    if tuple(weights.shape) != (t, p) or weights.dtype != torch.float32:
        raise ValueError(f"weights must be fp32 [T={t}, P={p}], got {weights.dtype} {tuple(weights.shape)}")
    if not 0 <= n_shared <= p:
        raise ValueError(f"n_shared {n_shared} must lie in [0, P={p}]")
    if n_shared and shared is not None:
        raise ValueError("shared experts are either folded into pieces (n_shared) or passed as shared, not both")
    return _rows(shared, "shared", t, h), _rows(residual, "residual", t, h), \
        (weights if weights.stride(1) == 1 else weights.contiguous())


def moe_sum(pieces: torch.Tensor, weights: torch.Tensor, n_shared: int = 0,
            shared: torch.Tensor | None = None, residual: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """pieces [T, P, H], weights [T, P] -> [T, H] (see the module docstring); the last n_shared
    of the P columns are folded shared experts (their weights are not read)."""
    shared, residual, w = _check(pieces, weights, n_shared, shared, residual)
    t, p, h = pieces.shape
    out = torch.empty(t, h, dtype=pieces.dtype, device=pieces.device) if out is None else out
    if tuple(out.shape) != (t, h) or out.stride(1) != 1:
        raise ValueError(f"out must be [T={t}, H={h}] with unit column stride, got {tuple(out.shape)}")
    if t == 0 or h == 0:
        return out
    block_h = min(512, triton.next_power_of_2(h))  # T = 1, H = 2048: 4 programs
    sh = shared if shared is not None else out  # never read when absent
    res = residual if residual is not None else out
    _moe_sum_kernel[(t, triton.cdiv(h, block_h))](
        pieces, w, sh, res, out, h, p - n_shared,
        pieces.stride(0), pieces.stride(1), w.stride(0), sh.stride(0), res.stride(0), out.stride(0),
        N_SHARED=n_shared, HAS_SHARED=shared is not None, HAS_RESIDUAL=residual is not None,
        BLOCK_H=block_h, num_warps=4 if block_h >= 512 else 1, **pdl.launch(out.device))
    return out


@dataclass
class MoESumInputs:
    """A MoE layer's output before its sum: moe_sum's arguments, kept for the next launch that sums
    them (moe_sum_rms_norm: the following decoder layer's input norm). `materialize` sums them alone."""

    pieces: torch.Tensor  # [T, P, H]
    weights: torch.Tensor  # fp32 [T, P]
    n_shared: int
    shared: torch.Tensor | None  # [T, H]
    residual: torch.Tensor | None  # [T, H]
    shape: tuple  # the layer output's shape, [..., H]

    def materialize(self) -> torch.Tensor:
        return moe_sum(self.pieces, self.weights, self.n_shared, self.shared, self.residual).view(self.shape)


def moe_sum_rms_norm(inputs: MoESumInputs, norm_weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s, norm_weight), s) for s = inputs.materialize(), in one launch, bit for bit the two
    launches' values (the same per-column sums; the variance over the same block and warps)."""
    pieces = inputs.pieces
    shared, residual, w = _check(pieces, inputs.weights, inputs.n_shared, inputs.shared, inputs.residual)
    t, p, h = pieces.shape
    if norm_weight.shape != (h,):
        raise ValueError(f"norm weight has shape {tuple(norm_weight.shape)}, expected [{h}]")
    block, warps = norm_launch(h, "moe_sum_rms_norm")
    out = torch.empty(t, h, dtype=pieces.dtype, device=pieces.device)
    normed = torch.empty_like(out)
    if t:
        sh = shared if shared is not None else out  # never read when absent
        res = residual if residual is not None else out
        _moe_sum_rms_norm_kernel[(t,)](
            pieces, w, sh, res, out, norm_weight, normed, h, p - inputs.n_shared, eps,
            pieces.stride(0), pieces.stride(1), w.stride(0), sh.stride(0), res.stride(0), out.stride(0),
            normed.stride(0), N_SHARED=inputs.n_shared, HAS_SHARED=shared is not None,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps, **pdl.launch(out.device))
    return normed.view(inputs.shape), out.view(inputs.shape)
