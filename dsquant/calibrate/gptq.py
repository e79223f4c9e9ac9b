"""GPTQ (Frantar et al., arXiv 2210.17323), our implementation.

Columns are quantized one at a time in blocks of 128; each column's rounding error is spread
over the not-yet-quantized columns through the inverse Hessian H^-1 (upper Cholesky factor),
with H = 2/n sum x x^T from the layer's real inputs, dampened by damp_percent of its mean
diagonal. Group parameters are fixed when the group's first column is reached (on the updated
weights). Act-order quantizes columns by decreasing H diagonal; g_idx then maps each input
channel to its group, as GPTQ v1 stores it.
"""
from __future__ import annotations

import torch

from dsquant.calibrate.quantizers import QuantizedWeight
from dsquant.calibrate.recipe import GPTQOptions, SchemeSpec


class HessianAccumulator:
    """Running H = 2/n sum x^T x over input rows x [T, K] (fp32)."""

    def __init__(self, k: int, device):
        self.h = torch.zeros(k, k, dtype=torch.float32, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        t = x.shape[0]
        if t == 0:
            return
        self.h.mul_(self.n / (self.n + t))
        self.n += t
        x = x * (2 / self.n) ** 0.5
        self.h.addmm_(x.t(), x)


def _group_params(w: torch.Tensor, qmax: int, sym: bool, scale_dtype: torch.dtype):
    """Scale/zero for each row of w [N, G] (fp32), scale rounded to its export dtype."""
    if sym:
        amax = w.abs().amax(1)
        scale = (amax * 2 / qmax)
        zero = torch.full_like(scale, (qmax + 1) // 2)
    else:
        wmax, wmin = w.amax(1).clamp(min=0), w.amin(1).clamp(max=0)
        scale = (wmax - wmin) / qmax
        # zero >= 1: GPTQ v1 stores zero - 1, so a zero point of 0 is not representable
        zero = torch.round(-wmin / scale.clamp(min=1e-8)).clamp(1, qmax)
    scale = scale.clamp(min=1e-8).to(scale_dtype).to(torch.float32).clamp(min=torch.finfo(scale_dtype).tiny)
    return scale, zero


def gptq_quantize(weight: torch.Tensor, hessian: HessianAccumulator, spec: SchemeSpec,
                  opts: GPTQOptions, scale_dtype: torch.dtype) -> QuantizedWeight:
    """weight [N, K] fp32 -> QuantizedWeight with q, scales, zeros [N, K/G] and g_idx [K]."""
    w = weight.clone().to(torch.float32)
    n, k = w.shape
    g, qmax, block = spec.group_size, 2 ** spec.bits - 1, opts.block_size
    h = hessian.h.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True) if opts.act_order else torch.arange(k, device=w.device)
    w, h = w[:, perm], h[perm][:, perm]
    h += opts.damp_percent * torch.mean(torch.diag(h)) * torch.eye(k, device=w.device)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    q = torch.zeros(n, k, dtype=torch.int32, device=w.device)
    deq = torch.zeros_like(w)
    scales = torch.zeros(n, k // g, device=w.device)
    zeros = torch.zeros(n, k // g, dtype=torch.int32, device=w.device)
    scale = zero = None
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, hinv1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:  # group params on the updated weights of the group's columns
                cols = torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, :g]
                scale, zero = _group_params(cols, qmax, opts.sym, scale_dtype)
                scales[:, col // g], zeros[:, col // g] = scale, zero.to(torch.int32)
            c = w1[:, i]
            code = torch.clamp(torch.round(c / scale) + zero, 0, qmax)
            q[:, col] = code.to(torch.int32)
            deq[:, col] = (code - zero) * scale
            e = (c - deq[:, col]) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    g_idx = (torch.arange(k, device=w.device) // g)[inv].to(torch.int32)  # group of each channel
    return QuantizedWeight(spec, deq[:, inv].contiguous(), q=q[:, inv].contiguous(),
                           scales=scales.to(scale_dtype), zeros=zeros, g_idx=g_idx)
