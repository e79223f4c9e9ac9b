"""INT4 experts dequantized to the activation dtype in one launch, for prefill-sized MoE batches.

With hundreds of (token, expert) pairs per expert (a prompt's 8192-token chunk gives V2-Lite about
770 per expert), the grouped GEMM is compute-bound and the INT4 MMA kernel, which dequantizes each
tile through shared memory for every BLOCK_M rows, runs well below the bf16 kernel's tensor-core
rate. Dequantizing every expert once per call (about 1.1 GB written for V2-Lite's w13 + w2, well
under a millisecond on an H200) and running the bf16 grouped GEMM costs less; fused_moe decides.

Layouts
- in: GroupedWeight("int4") (moe_gemm.py): qweight int32 [E, N/16, K/128, 16, 16], word i of row r in
  chunk c, tile t holds in nibble j the code of W[16c + r, 128t + 32 (j % 4) + 2i + j // 4] (the paired
  order of fused_moe_int4); scales [E, K/G, N] in the activation dtype; zeros uint8 [E, K/G, N].
- out: [E, N, K] in the activation dtype, W[n, k] = (q - z[k // G, n]) * s[k // G, n], computed in fp32
  and rounded once; act-order experts (perm int32 [E, K]) store packed channel k at column perm[e, k],
  so the output is in the input channels' order either way.
Program (expert, block of ROWS rows, 128-column tile) reads the tile's words once and writes its
nibble planes j and j + 4 together, 32 consecutive columns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels.moe.moe_gemm import GroupedWeight


@triton.jit
def _dequant_int4_kernel(w_ptr, s_ptr, z_ptr, out_ptr, perm_ptr, N, K, num_tiles, stride_se, stride_sg, stride_oe,
                         stride_on, stride_pe, GROUP: tl.constexpr, ROWS: tl.constexpr, HAS_PERM: tl.constexpr = False):
    e = tl.program_id(0)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # [ROWS] output rows n
    t = tl.program_id(2)  # 128-column tile
    rmask = rows < N
    i = tl.arange(0, 16)
    words = ((e * (N // 16) + rows // 16).to(tl.int64) * num_tiles + t) * 256 + (rows % 16) * 16  # [ROWS]
    packed = tl.load(w_ptr + words[:, None] + i[None, :], mask=rmask[:, None], other=0)  # [ROWS, 16] int32
    for j in tl.static_range(4):
        k0 = t * 128 + 32 * j  # planes j (even columns) and j + 4 (odd columns)
        g = k0 // GROUP
        s = tl.load(s_ptr + e * stride_se + g * stride_sg + rows, mask=rmask, other=0.0).to(tl.float32)  # [ROWS]
        z = tl.load(z_ptr + e * stride_se + g * stride_sg + rows, mask=rmask, other=0).to(tl.float32)
        q_even = ((packed >> (4 * j)) & 0xF).to(tl.float32)  # [ROWS, 16]
        q_odd = ((packed >> (4 * j + 16)) & 0xF).to(tl.float32)
        q = tl.reshape(tl.join(q_even, q_odd), (ROWS, 32))  # column 2i + h: channel k0 + 2i + h
        w = (q - z[:, None]) * s[:, None]
        cols = k0 + tl.arange(0, 32)
        if HAS_PERM:  # act-order: packed channel k is input channel perm[e, k]
            cols = tl.load(perm_ptr + e * stride_pe + cols)
        tl.store(out_ptr + e * stride_oe + rows[:, None].to(tl.int64) * stride_on + cols[None, :],
                 w.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def dequantize_int4_grouped(w: GroupedWeight, dtype: torch.dtype, rows_per_program: int = 64) -> GroupedWeight:
    """GroupedWeight("int4") -> GroupedWeight("bf16") holding W [E, N, K] in `dtype`, the activations'
    (AWQ checkpoints store fp16 scales beside bf16 activations)."""
    if w.format != "int4":
        raise ValueError(f"dequantize_int4_grouped: expected int4 experts, got {w.format}")
    e, n, k = w.num_experts, w.n, w.k
    if w.zeros.stride() != w.scales.stride():
        raise ValueError("dequantize_int4_grouped: scales and zeros must share strides [E, K/G, N]")
    out = torch.empty(e, n, k, dtype=dtype, device=w.weight.device)
    grid = (e, triton.cdiv(n, rows_per_program), k // 128)
    perm = w.perm if w.perm is not None else w.zeros  # a stub pointer without act-order
    _dequant_int4_kernel[grid](w.weight, w.scales, w.zeros, out, perm, n, k, k // 128, w.scales.stride(0),
                               w.scales.stride(1), out.stride(0), out.stride(1), perm.stride(0), GROUP=w.group_size,
                               ROWS=rows_per_program, HAS_PERM=w.perm is not None, num_warps=4)
    return GroupedWeight("bf16", out, n=n, k=k)
