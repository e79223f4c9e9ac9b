"""W4A16 MMA kernel on the paired code order (int4_paired.py): codes dequantized in registers straight
into the dot.

Layouts: x [M, K] bf16/fp16 (unit column stride); qweight int32 [N, K/8] in the paired order of
w4a16_repack.slice_codes (K % 128 == 0): word 16c + i of row n holds, in nibble j (bits 4j..4j+3), the
code of k = 128c + 32 (j % 4) + 2i + j // 4; scales [K/G, N]; zeros uint8 [K/G, N]; perm int32 [K]
(optional, act-order); y [M, N] in x's dtype. G is 32, 64 or 128.

One 128-wide chunk of a row is 16 consecutive words. Per 32-channel slice, one lop3 and one packed
subtraction per word give the register of two K-neighbours (q - z exactly, int4_paired._pair), and the
slice's [BLOCK_N, 32] MMA operand is their join: no shared-memory round trip and no byte permutes, so
the dot runs as four K = 32 steps on the loaded words (the words come out of the cp.async ring with
one local_load in the register-operand layout; x slices are the other operand, in shared memory). The
dot accumulates sum_k (q - z) x in fp32 per group; the scale multiplies it once per group and output
row.
Tiles: acc[n, m] (the weight is the MMA's wide operand: out^T = W x^T), BLOCK_N weight rows by
BLOCK_M tokens, split-K over chunks through splitk.store_tile.
PREFETCH: chunk c + 1's zeros and scales are loaded during chunk c (w4a16_mma picks it; see there).
TILE_N > 0 (probe only): qweight is tile-major, [N / TILE_N, K / 128, TILE_N, 16] words.
The chunk's dot (int4_paired.chunk_dot_paired) is shared with the MoE grouped GEMM (moe_int4_loop.py).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.gemm.int4_paired import a_slice, chunk_dot_paired, slice_params
from dsquant.runtime.kernels.gemm.splitk import split_range, splitk_buffers, store_tile, swizzled_tile

_MAGIC = {torch.bfloat16: 0x4300, torch.float16: 0x6400}  # 128.0, 1024.0: ulp 1


@triton.jit(do_not_specialize=["M", "split_k"])
def _w4a16_mma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, part_ptr, counters_ptr,
                      M, N, num_chunks, stride_xm, stride_qn, stride_sg, stride_zg, stride_om, split_k,
                      GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                      HAS_PERM: tl.constexpr, MAGIC: tl.constexpr,
                      PAIRED: tl.constexpr, SWIZZLE: tl.constexpr, TILE_N: tl.constexpr = 0,
                      PREFETCH: tl.constexpr = True, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n, pid_m = swizzled_tile(pid, M, N, BLOCK_M, BLOCK_N, SWIZZLE)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_w = tl.arange(0, 16)  # the 16 words of one 128-wide chunk
    dtype = x_ptr.dtype.element_ty

    c_lo, c_hi = split_range(pid_k, num_chunks, split_k)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # PREFETCH: zeros and scales run one chunk ahead (plain loads; the pipeliner only prefetches the
    # dot's operands), so their latency hides behind a whole chunk's work
    z0, z1, z2, z3, s0, s1, s2, s3 = slice_params(z_ptr, s_ptr, tl.minimum(c_lo, num_chunks - 1), stride_zg,
                                                  stride_sg, offs_n, n_mask, GROUP, MAGIC)
    for c in range(c_lo, c_hi):
        if TILE_N > 0:  # tile-major: the TILE_N x 16 words of (row tile, chunk c) are contiguous
            qw = tl.load(qw_ptr + (offs_n // TILE_N * (num_chunks * TILE_N * 16) + offs_n % TILE_N * 16)[:, None]
                         + (c * (TILE_N * 16) + offs_w)[None, :], mask=n_mask[:, None], other=0)
        else:
            qw = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (c * 16 + offs_w)[None, :],
                         mask=n_mask[:, None], other=0)  # [BN, 16] int32
        if PREFETCH:
            y0, y1, y2, y3, t0, t1, t2, t3 = slice_params(z_ptr, s_ptr, tl.minimum(c + 1, c_hi - 1), stride_zg,
                                                          stride_sg, offs_n, n_mask, GROUP, MAGIC)
        else:  # this chunk's, loaded now
            z0, z1, z2, z3, s0, s1, s2, s3 = slice_params(z_ptr, s_ptr, c, stride_zg, stride_sg, offs_n, n_mask, GROUP,
                                                          MAGIC)
            y0, y1, y2, y3, t0, t1, t2, t3 = z0, z1, z2, z3, s0, s1, s2, s3
        k0 = c * 128
        acc = chunk_dot_paired(acc, qw, z0, z1, z2, z3, s0, s1, s2, s3,
                               a_slice(x_ptr, perm_ptr, offs_m, m_mask, stride_xm, k0, HAS_PERM),
                               a_slice(x_ptr, perm_ptr, offs_m, m_mask, stride_xm, k0 + 32, HAS_PERM),
                               a_slice(x_ptr, perm_ptr, offs_m, m_mask, stride_xm, k0 + 64, HAS_PERM),
                               a_slice(x_ptr, perm_ptr, offs_m, m_mask, stride_xm, k0 + 96, HAS_PERM),
                               GROUP, MAGIC, PAIRED, dtype, BLOCK_N)
        z0, z1, z2, z3, s0, s1, s2, s3 = y0, y1, y2, y3, t0, t1, t2, t3
    store_tile(acc, out_ptr, part_ptr, counters_ptr, offs_n, offs_m, M, N, stride_om, pid, pid_k, split_k)


def paired_default() -> bool:
    """Whether to emit inline PTX (the paired dequantization here, the one-lop3 nibble conversion of
    the GEMVs): on a real GPU, not under TRITON_INTERPRET."""
    return os.environ.get("TRITON_INTERPRET", "0") != "1"


def w4a16_mma(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int, out: torch.Tensor, block_n: int, block_m: int, split_k: int,
              num_warps: int = 4, num_stages: int = 4, perm: torch.Tensor | None = None,
              counters: torch.Tensor | None = None, paired: bool | None = None, tile_n: int = 0,
              prefetch: bool | None = None) -> torch.Tensor:
    """out [M, N] = x2 [M, K] @ dequant(W)^T with W's codes in the paired order (module doc)."""
    m, k = x2.shape
    n = qweight.shape[0] if not tile_n else qweight.numel() * 8 // k
    if group_size not in (32, 64, 128) or k % 128:
        raise ValueError(f"w4a16_mma: needs group_size 32, 64 or 128 and K % 128 == 0, got {group_size}, {k}")
    chunks = k // 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = max(1, min(split_k, chunks))
    part, counters = splitk_buffers(split, m, n, tiles, counters, x2.device)
    magic = _MAGIC[x2.dtype]
    # H200 (w4a16_mma_probe --prefetch-ab, 2026-12-03, 16 shape x M points): the one-chunk-ahead
    # zeros and scales win on every BLOCK_N 128 config (4-31%: 7168 x 18432 at M = 64, 7168 x 4096,
    # 2048 x 10944) and lose on every BLOCK_N 64 one (7-17%: 7168 x 18432 at M <= 16, 2048 x 2816),
    # where the extra registers cost more occupancy than the hidden latency buys
    if prefetch is None:
        prefetch = block_n >= 128
    _w4a16_mma_kernel[(tiles, split)](
        x2, qweight, scales, zeros, perm if perm is not None else qweight, out, part, counters,
        m, n, chunks, x2.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
        split, GROUP=group_size, BLOCK_N=block_n, BLOCK_M=block_m, HAS_PERM=perm is not None,
        MAGIC=magic, PAIRED=paired_default() if paired is None else paired, SWIZZLE=8, TILE_N=tile_n, PREFETCH=prefetch,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch(x2.device))
    return out
