"""W4A16 MMA kernel on the "k-sliced" code order: codes dequantized in registers straight into the dot.

Layouts: x [M, K] bf16/fp16 (unit column stride); qweight int32 [N, K/8] in the k-sliced order of
w4a16_repack.slice_codes (K % 128 == 0): word 16c + w of row n holds, in nibble i (bits 4i..4i+3), the code of
k = 128c + 16i + w; scales [K/G, N]; zeros uint8 [K/G, N]; perm int32 [K] (optional, act-order);
y [M, N] in x's dtype. G is 32, 64 or 128.

Why this order: one 128-wide chunk of a row is 16 consecutive words, and the eight nibble planes
of those words are eight [BLOCK_N, 16] K-slices of the weight tile, each one shift and one mask
away from the loaded words. No join, reshape or permute of the unpacked tile (the plain order
needed them, and they cost a shared-memory round trip per tile), so each slice goes from the
loaded words to the MMA's operand in registers, and the dot runs as eight K = 16 steps on it
(the sm_90 TTGIR: the words come out of the cp.async ring with one local_load in the wgmma's
register-A layout; x slices are the B operand in shared memory).

Dequantization never converts integer to float: a code OR-ed into the mantissa of 128.0 (bf16
0x4300; fp16 1024.0 = 0x6400) is OFFSET + q exactly, and subtracting OFFSET + z (built the same way)
gives q - z exactly. PAIRED does both for two codes per instruction: (word >> 4j) & 0x000F000F |
MAGIC2 holds slice j in the low half and slice j + 4 in the high half of one register, and one
packed sub.bf16x2 (sub.f16x2) takes the zero points of both halves' groups
(`tl.inline_asm_elementwise`; not under TRITON_INTERPRET, where the same arithmetic runs unpacked).
The dot accumulates sum_k (q - z) x in fp32 per group; the scale multiplies it once per group and
output row.
Tiles: acc[n, m] (the weight is the MMA's wide operand: out^T = W x^T), BLOCK_N weight rows by
BLOCK_M tokens, split-K over chunks through splitk.store_tile.
PREFETCH: chunk c + 1's zeros and scales are loaded during chunk c (w4a16_mma picks it; see there).
TILE_N > 0 (probe only): qweight is tile-major, [N / TILE_N, K / 128, TILE_N, 16] words.
chunk_params / chunk_dot are shared with the MoE grouped GEMM (moe_int4_loop.py).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.gemm.splitk import split_range, splitk_buffers, store_tile, swizzled_tile

_MAGIC = {torch.bfloat16: 0x4300, torch.float16: 0x6400}  # 128.0, 1024.0: ulp 1


@triton.jit
def _pair(qw, zz, SHIFT: tl.constexpr, MAGIC: tl.constexpr, PAIRED: tl.constexpr, dtype: tl.constexpr):
    """words [BN, 16] -> (q - z) of slices j and j + 4 in `dtype` (exact small integers), j = SHIFT / 4.

    zz int32 [BN, 16]: the bit patterns of OFFSET + z for slice j (low half) and slice j + 4 (high
    half; MAGIC 0: plain z, for fp32). PAIRED: one lop3 and one packed subtraction for two codes."""
    t = qw >> SHIFT
    if MAGIC == 0:  # fp32 activations (the MoE GEMM on CPU): q - z as integers, converted exactly
        return (((t & 0xF) - (zz & 0xFFFF)).to(dtype), (((t >> 16) & 0xF) - ((zz >> 16) & 0xFFFF)).to(dtype))
    if PAIRED:
        if MAGIC == 0x4300:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xEA; sub.rn.bf16x2 t, t, $3; "
                "mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r", [t, zz], dtype=(tl.int16, tl.int16), is_pure=True, pack=1)
        else:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x64006400, 0xEA; sub.rn.f16x2 t, t, $3; "
                "mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r", [t, zz], dtype=(tl.int16, tl.int16), is_pure=True, pack=1)
        return lo.to(dtype, bitcast=True), hi.to(dtype, bitcast=True)
    lo = ((t & 0xF) | MAGIC).to(tl.int16).to(dtype, bitcast=True)
    hi = (((t >> 16) & 0xF) | MAGIC).to(tl.int16).to(dtype, bitcast=True)
    z_lo = (zz & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
    z_hi = ((zz >> 16) & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
    return lo - z_lo, hi - z_hi


@triton.jit
def _x_slice(x_ptr, perm_ptr, offs_m, m_mask, stride_xm, k0, HAS_PERM: tl.constexpr):
    """x[:, k0 : k0 + 16]^T -> [16, BM] (through perm under act-order)."""
    k_idx = k0 + tl.arange(0, 16)
    if HAS_PERM:
        k_idx = tl.load(perm_ptr + k_idx)
    return tl.load(x_ptr + offs_m[None, :] * stride_xm + k_idx[:, None], mask=m_mask[None, :], other=0.0)


@triton.jit
def _zero_pair(z_ptr, g_lo, g_hi, stride_zg, row_off, n_mask, MAGIC: tl.constexpr):
    """int32 [BN]: OFFSET + z of group g_lo in the low half, of g_hi in the high half (row_off [BN]:
    the rows' element offsets)."""
    z_lo = tl.load(z_ptr + g_lo * stride_zg + row_off, mask=n_mask, other=0).to(tl.int32) | MAGIC
    z_hi = tl.load(z_ptr + g_hi * stride_zg + row_off, mask=n_mask, other=0).to(tl.int32) | MAGIC
    return z_lo | (z_hi << 16)


@triton.jit
def _scale(s_ptr, g, stride_sg, row_off, n_mask):
    return tl.load(s_ptr + g * stride_sg + row_off, mask=n_mask, other=0.0).to(tl.float32)[:, None]  # [BN, 1]


@triton.jit
def chunk_params(z_ptr, s_ptr, c, stride_zg, stride_sg, row_off, n_mask, GROUP: tl.constexpr, MAGIC: tl.constexpr):
    """Chunk c's zero pairs [BN] (zz0 for slices 0, 1 (+4), zz1 for 2, 3 (+4)) and scales s0..s3 [BN, 1]
    (zeros at z_ptr + g * stride_zg + row_off, scales likewise).
    G 128: one group (s0); G 64: halves 2c, 2c + 1 (s0, s1); G 32: groups 4c..4c + 3 (s0..s3)."""
    if GROUP == 128:
        zz0 = _zero_pair(z_ptr, c, c, stride_zg, row_off, n_mask, MAGIC)
        zz1 = zz0
        s0 = _scale(s_ptr, c, stride_sg, row_off, n_mask)
        s1 = s0
        s2 = s0
        s3 = s0
    elif GROUP == 64:
        zz0 = _zero_pair(z_ptr, 2 * c, 2 * c + 1, stride_zg, row_off, n_mask, MAGIC)
        zz1 = zz0
        s0 = _scale(s_ptr, 2 * c, stride_sg, row_off, n_mask)
        s1 = _scale(s_ptr, 2 * c + 1, stride_sg, row_off, n_mask)
        s2 = s0  # unused
        s3 = s1
    else:  # 32: slices (0, 1) group 4c, (2, 3) 4c + 1, (4, 5) 4c + 2, (6, 7) 4c + 3
        zz0 = _zero_pair(z_ptr, 4 * c, 4 * c + 2, stride_zg, row_off, n_mask, MAGIC)
        zz1 = _zero_pair(z_ptr, 4 * c + 1, 4 * c + 3, stride_zg, row_off, n_mask, MAGIC)
        s0 = _scale(s_ptr, 4 * c, stride_sg, row_off, n_mask)
        s1 = _scale(s_ptr, 4 * c + 1, stride_sg, row_off, n_mask)
        s2 = _scale(s_ptr, 4 * c + 2, stride_sg, row_off, n_mask)
        s3 = _scale(s_ptr, 4 * c + 3, stride_sg, row_off, n_mask)
    return zz0, zz1, s0, s1, s2, s3


@triton.jit
def chunk_dot(acc, qw, zz0, zz1, s0, s1, s2, s3, x_lo_0, x_hi_0, x_lo_1, x_hi_1, x_lo_2, x_hi_2, x_lo_3, x_hi_3,
              GROUP: tl.constexpr, MAGIC: tl.constexpr, PAIRED: tl.constexpr, dtype: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc [BN, BM] += one 128-channel chunk: words qw [BN, 16] (slice j = nibble plane j) times the
    x^T slices [16, BM] of channels 16j (x_lo_j) and 64 + 16j (x_hi_j); zz / s from chunk_params."""
    d_lo = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # slices j
    d_hi = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # slices j + 4
    for j in tl.static_range(4):
        if j < 2:
            zz = tl.broadcast_to(zz0[:, None], (BLOCK_N, 16))
        else:
            zz = tl.broadcast_to(zz1[:, None], (BLOCK_N, 16))
        w_lo, w_hi = _pair(qw, zz, 4 * j, MAGIC, PAIRED, dtype)  # [BN, 16] each
        if j == 0:
            x_lo, x_hi = x_lo_0, x_hi_0
        elif j == 1:
            x_lo, x_hi = x_lo_1, x_hi_1
        elif j == 2:
            x_lo, x_hi = x_lo_2, x_hi_2
        else:
            x_lo, x_hi = x_lo_3, x_hi_3
        if GROUP == 128:  # one chain: the whole chunk is one group
            d_lo = tl.dot(w_lo, x_lo, d_lo)
            d_lo = tl.dot(w_hi, x_hi, d_lo)
        else:
            d_lo = tl.dot(w_lo, x_lo, d_lo)
            d_hi = tl.dot(w_hi, x_hi, d_hi)
        if GROUP == 32 and j == 1:  # groups 4c (slices 0, 1) and 4c + 2 (slices 4, 5)
            acc += s0 * d_lo + s2 * d_hi
            d_lo = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            d_hi = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if GROUP == 128:
        acc += s0 * d_lo
    elif GROUP == 64:  # halves 2c, 2c + 1
        acc += s0 * d_lo + s1 * d_hi
    else:  # groups 4c + 1 and 4c + 3
        acc += s1 * d_lo + s3 * d_hi
    return acc


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
    zz0, zz1, s0, s1, s2, s3 = chunk_params(z_ptr, s_ptr, tl.minimum(c_lo, num_chunks - 1), stride_zg, stride_sg,
                                            offs_n, n_mask, GROUP, MAGIC)
    for c in range(c_lo, c_hi):
        if TILE_N > 0:  # tile-major: the TILE_N x 16 words of (row tile, chunk c) are contiguous
            qw = tl.load(qw_ptr + (offs_n // TILE_N * (num_chunks * TILE_N * 16) + offs_n % TILE_N * 16)[:, None]
                         + (c * (TILE_N * 16) + offs_w)[None, :], mask=n_mask[:, None], other=0)
        else:
            qw = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (c * 16 + offs_w)[None, :],
                         mask=n_mask[:, None], other=0)  # [BN, 16] int32
        if PREFETCH:
            nz0, nz1, t0, t1, t2, t3 = chunk_params(z_ptr, s_ptr, tl.minimum(c + 1, c_hi - 1), stride_zg,
                                                    stride_sg, offs_n, n_mask, GROUP, MAGIC)
        else:  # this chunk's, loaded now
            zz0, zz1, s0, s1, s2, s3 = chunk_params(z_ptr, s_ptr, c, stride_zg, stride_sg, offs_n, n_mask,
                                                    GROUP, MAGIC)
            nz0, nz1, t0, t1, t2, t3 = zz0, zz1, s0, s1, s2, s3
        k0 = c * 128
        acc = chunk_dot(acc, qw, zz0, zz1, s0, s1, s2, s3,
                        _x_slice(x_ptr, perm_ptr, offs_m, m_mask, stride_xm, k0, HAS_PERM),
                        _x_slice(x_ptr, perm_ptr, offs_m, m_mask, stride_xm, k0 + 64, HAS_PERM),
                        _x_slice(x_ptr, perm_ptr, offs_m, m_mask, stride_xm, k0 + 16, HAS_PERM),
                        _x_slice(x_ptr, perm_ptr, offs_m, m_mask, stride_xm, k0 + 80, HAS_PERM),
                        _x_slice(x_ptr, perm_ptr, offs_m, m_mask, stride_xm, k0 + 32, HAS_PERM),
                        _x_slice(x_ptr, perm_ptr, offs_m, m_mask, stride_xm, k0 + 96, HAS_PERM),
                        _x_slice(x_ptr, perm_ptr, offs_m, m_mask, stride_xm, k0 + 48, HAS_PERM),
                        _x_slice(x_ptr, perm_ptr, offs_m, m_mask, stride_xm, k0 + 112, HAS_PERM),
                        GROUP, MAGIC, PAIRED, dtype, BLOCK_N, BLOCK_M)
        zz0, zz1, s0, s1, s2, s3 = nz0, nz1, t0, t1, t2, t3
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
    """out [M, N] = x2 [M, K] @ dequant(W)^T with W's codes in the k-sliced order (module doc)."""
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
