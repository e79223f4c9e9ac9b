"""GPTQ (Frantar et al., arXiv 2210.17323), our implementation.

Columns are quantized one at a time in blocks of 128; each column's rounding error is spread
over the not-yet-quantized columns through the inverse Hessian H^-1 (upper Cholesky factor),
with H = 2/n sum x x^T from the layer's real inputs, dampened by damp_percent of its mean
diagonal. Act-order quantizes columns by decreasing H diagonal.

Group grids (scale, zero per output row and group of G input columns), two ways:
- static_groups (the default): every group's grid from the weights before GPTQ moves them, the
  groups in the original column order, whatever order act-order visits the columns in; so g_idx is
  the identity and any INT4 format stores the result (llm-compressor's "static" act-order).
- otherwise: a group's grid from its updated weights when GPTQ reaches its first column; with
  act-order the groups are then runs of the permuted order, and g_idx maps each input channel to
  its group, as GPTQ v1 stores it (desc_act).
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
    return gptq_quantize_batch(weight[None], hessian.h[None], spec, opts, scale_dtype)[0]


def gptq_quantize_batch(weight: torch.Tensor, hessian: torch.Tensor, spec: SchemeSpec,
                        opts: GPTQOptions, scale_dtype: torch.dtype) -> list[QuantizedWeight]:
    """E Linears of one shape at once (a MoE layer's routed experts): weight [E, N, K] fp32 and
    their Hessians [E, K, K] -> E QuantizedWeights. Each column step runs on all E together, so a
    DeepSeek-V3 layer's 768 expert projections take 3 column loops instead of 768; every expert's
    arithmetic is its own (its Hessian, its act-order permutation), as gptq_quantize one by one."""
    w = weight.clone().to(torch.float32)
    e_n, n, k = w.shape
    g, qmax, block = spec.group_size, 2 ** spec.bits - 1, opts.block_size
    dev = w.device
    h = hessian.clone().to(torch.float32)  # [E, K, K]
    dead = torch.diagonal(h, dim1=1, dim2=2) == 0  # [E, K]
    torch.diagonal(h, dim1=1, dim2=2).masked_fill_(dead, 1)
    w.masked_fill_(dead[:, None, :], 0)
    if opts.static_groups:  # every group's grid from the weights before GPTQ moves them, original column order
        s0, z0 = _group_params(w.reshape(e_n * n * (k // g), g), qmax, opts.sym, scale_dtype)
        s0, z0 = s0.reshape(e_n, n, k // g), z0.reshape(e_n, n, k // g)
    if opts.act_order:
        perm = torch.argsort(torch.diagonal(h, dim1=1, dim2=2), dim=1, descending=True)  # [E, K]
    else:
        perm = torch.arange(k, device=dev).expand(e_n, k)
    w = torch.gather(w, 2, perm[:, None, :].expand(e_n, n, k))
    h = torch.gather(torch.gather(h, 1, perm[:, :, None].expand(e_n, k, k)), 2, perm[:, None, :].expand(e_n, k, k))
    damp = opts.damp_percent * torch.diagonal(h, dim1=1, dim2=2).mean(1)  # [E]
    torch.diagonal(h, dim1=1, dim2=2).add_(damp[:, None])
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # [E, K, K]
    del h

    q = torch.zeros(e_n, n, k, dtype=torch.int32, device=dev)
    deq = torch.zeros_like(w)
    scales = torch.zeros(e_n, n, k // g, device=dev)
    zeros = torch.zeros(e_n, n, k // g, dtype=torch.int32, device=dev)
    scale = zero = None
    if opts.static_groups:
        scales[:], zeros[:] = s0, z0.to(torch.int32)
        col_group = perm // g  # [E, K]: the (original) group of each column in quantization order
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, hinv1 = w[:, :, i1:i2].clone(), hinv[:, i1:i2, i1:i2]  # [E, N, B], [E, B, B]
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            col = i1 + i
            if opts.static_groups:  # act-order visits groups out of order: gather each column's grid
                idx = col_group[:, col][:, None, None].expand(e_n, n, 1)
                scale, zero = torch.gather(s0, 2, idx)[..., 0], torch.gather(z0, 2, idx)[..., 0]  # [E, N]
            elif col % g == 0:  # group params on the updated weights of the group's columns
                cols = torch.cat([w1[:, :, i:], w[:, :, i2:]], dim=2)[:, :, :g]  # [E, N, G]
                scale, zero = _group_params(cols.reshape(e_n * n, -1), qmax, opts.sym, scale_dtype)
                scale, zero = scale.reshape(e_n, n), zero.reshape(e_n, n)
                scales[:, :, col // g], zeros[:, :, col // g] = scale, zero.to(torch.int32)
            c = w1[:, :, i]  # [E, N]
            code = torch.clamp(torch.round(c / scale) + zero, 0, qmax)
            q[:, :, col] = code.to(torch.int32)
            deq[:, :, col] = (code - zero) * scale
            err = (c - deq[:, :, col]) / hinv1[:, i, i][:, None]  # [E, N]
            w1[:, :, i:] -= err[:, :, None] * hinv1[:, i, i:][:, None, :]
            err1[:, :, i] = err
        w[:, :, i2:] -= torch.bmm(err1, hinv[:, i1:i2, i2:])
    inv = torch.argsort(perm, dim=1)  # [E, K]
    out = []
    for e in range(e_n):
        # group of each channel: static groups stay in the original order (no act-order g_idx to store)
        g_idx = torch.arange(k, device=dev) // g if opts.static_groups else (torch.arange(k, device=dev) // g)[inv[e]]
        g_idx = g_idx.to(torch.int32)
        out.append(QuantizedWeight(spec, deq[e][:, inv[e]].contiguous(), q=q[e][:, inv[e]].contiguous(),
                                   scales=scales[e].to(scale_dtype), zeros=zeros[e], g_idx=g_idx))
    return out
