"""W4A16 GEMV for decode batches of 1..4 tokens (dispatched at M <= gemm_configs.GEMV_MAX_M): y = x @ dequant(W)^T without tensor cores.

Layouts (the kernel layout of w4a16_repack.py): x [M, K] bf16/fp16 (unit column stride);
qweight int32 [N, K/8] packed along K (nibble i of word c holds k = 8c + i); scales [K/G, N];
zeros uint8 [K/G, N]; perm int32 [K] (optional, GPTQ act-order); y [M, N] in x's dtype.

At M <= 4 the MMA path pads the token side to 16 and spends its time moving unpacked codes
through shared memory; a GEMV keeps everything in registers. Each program owns BLOCK_N output
channels and a run of groups (split-K, splitk.store_tile's one-launch epilogue), and per group:
  - loads the [BLOCK_N, G/8] words (each row's G/8 words are contiguous: 16-byte vector loads),
  - turns each code into the fp32 value 128 + q with one shift and one AND-OR: fp32 128.0 is
    0x43000000 and its unit in the last place is 2^-16, so a code OR-ed into bits 16..19 adds
    exactly q (no integer-to-float conversion),
  - for each token: d = sum_k (128 + q) x in fp32, then
        sum_{k in g} (q - z) s x = s * (d - (128 + z) * sum_{k in g} x).
The weight is read and unpacked once for all BLOCK_M tokens. `_w4a16_gemv_sliced_kernel` is the
same over the paired code order (int4_paired.py, w4a16_repack.slice_codes): a group's nibble planes
are unpacked by in-thread joins as above, and x is gathered in the order the unpacked columns come out.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.gemm.w4a16_mma import paired_default
from dsquant.runtime.kernels.gemm.splitk import split_range, splitk_buffers, store_tile


@triton.jit
def mask_or_f32(bits, ASM: tl.constexpr):
    """fp32 with the bit pattern (bits & 0xF0000) | 0x43000000, i.e. 128 + the nibble at bits 16..19.
    ASM (a GPU, not TRITON_INTERPRET): one lop3; ptxas issues the plain form as two LOP3s a code
    (the sm_90 SASS of the MoE GEMV: 260 LOP3 in a 737-instruction loop body, 132 of 611 with it)."""
    if ASM:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, 983040, 1124073472, 234;", "=r,r", [bits],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return ((bits & 0xF0000) | 0x43000000).to(tl.float32, bitcast=True)


@triton.jit
def plane_f32(packed, high, J: tl.constexpr, ASM: tl.constexpr):
    """Nibble plane J of int32 words -> fp32 128 + q (same shape); high = packed >> 16, so planes 5..7
    take a left shift (which ptxas may issue as an IMAD on the FMA pipe) like planes 0..3, and
    plane 4 none."""
    if J == 4:
        bits = packed
    elif J < 4:
        bits = packed << (16 - 4 * J)
    else:
        bits = high << (32 - 4 * J)
    return mask_or_f32(bits, ASM)


@triton.jit
def _nib(qw, I: tl.constexpr, ASM: tl.constexpr):
    """fp32 128 + nibble I of each word (the code at bits 16..19 of 128.0)."""
    if I <= 4:
        v = qw << (16 - 4 * I)
    else:
        v = qw >> (4 * I - 16)
    return mask_or_f32(v, ASM)


@triton.jit
def codes_as_f32(qw, ROWS: tl.constexpr, COLS: tl.constexpr, ASM: tl.constexpr = False):
    """int32 [ROWS, COLS/8] -> fp32 [ROWS, COLS] = 128 + q; column 8c + i = nibble i of word c."""
    # join adds a minor axis of 2: three levels give index 4*i0 + 2*i1 + i2 = nibble
    q = tl.join(tl.join(tl.join(_nib(qw, 0, ASM), _nib(qw, 4, ASM)), tl.join(_nib(qw, 2, ASM), _nib(qw, 6, ASM))),
                tl.join(tl.join(_nib(qw, 1, ASM), _nib(qw, 5, ASM)), tl.join(_nib(qw, 3, ASM), _nib(qw, 7, ASM))))
    return tl.reshape(q, (ROWS, COLS))  # [ROWS, COLS/8, 2, 2, 2] -> [ROWS, COLS]


@triton.jit(do_not_specialize=["M", "split_k"])  # one compile for any M <= BLOCK_M and any split
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, part_ptr, counters_ptr,
                       M, N, num_groups, stride_xm, stride_qn, stride_sg, stride_zg, stride_om,
                       split_k, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                       HAS_PERM: tl.constexpr, ASM: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    n_mask = offs_n < N
    offs_w = tl.arange(0, GROUP // 8)  # [G/8] packed words of one group
    offs_k = tl.arange(0, GROUP)  # [G]

    g_lo, g_hi = split_range(pid_k, num_groups, split_k)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for g in range(g_lo, g_hi):
        qw = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (g * (GROUP // 8) + offs_w)[None, :],
                     mask=n_mask[:, None], other=0)  # [BN, G/8] int32
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
        z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_mask, other=0).to(tl.float32) + 128.0
        k_idx = g * GROUP + offs_k  # [G]
        if HAS_PERM:
            k_idx = tl.load(perm_ptr + k_idx)
        w = codes_as_f32(qw, BLOCK_N, GROUP, ASM)  # [BN, G] = 128 + q
        for m in tl.static_range(BLOCK_M):
            x = tl.load(x_ptr + m * stride_xm + k_idx, mask=(k_idx >= 0) & (m < M),
                        other=0.0).to(tl.float32)  # [G]
            d = tl.sum(w * x[None, :], axis=1)  # [BN]
            part = s * (d - z * tl.sum(x, axis=0))  # [BN]
            acc += tl.where(offs_m[None, :] == m, part[:, None], 0.0)
    store_tile(acc, out_ptr, part_ptr, counters_ptr, offs_n, offs_m, M, N, stride_om,
               pid_n, pid_k, split_k)


@triton.jit
def paired_group_f32(qw, GI: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, ASM: tl.constexpr = False):
    """words [ROWS, 16] in the paired order (int4_paired.py) -> fp32 [ROWS, GROUP] = 128 + q of the chunk's
    group GI, by in-thread joins (each adds a minor axis of 2); column col holds the group's channel
    paired_group_channel(col)."""
    if GROUP == 32:  # slice GI: column 2i + h, nibble GI + 4h
        q = tl.join(_nib(qw, GI, ASM), _nib(qw, GI + 4, ASM))
    elif GROUP == 64:  # slices 2GI + s: column 4i + 2h + s
        q = tl.join(tl.join(_nib(qw, 2 * GI, ASM), _nib(qw, 2 * GI + 4, ASM)),
                    tl.join(_nib(qw, 2 * GI + 1, ASM), _nib(qw, 2 * GI + 5, ASM)))
    else:  # slices u + 2v: column 8i + 4h + 2u + v
        q = tl.join(tl.join(tl.join(_nib(qw, 0, ASM), _nib(qw, 4, ASM)), tl.join(_nib(qw, 1, ASM), _nib(qw, 5, ASM))),
                    tl.join(tl.join(_nib(qw, 2, ASM), _nib(qw, 6, ASM)), tl.join(_nib(qw, 3, ASM), _nib(qw, 7, ASM))))
    return tl.reshape(q, (ROWS, GROUP))


@triton.jit
def paired_group_channel(col, GROUP: tl.constexpr):
    """Column col of paired_group_f32 -> its channel, counted from the group's first (slice 32 s, word
    i: 2i, half h: + h)."""
    if GROUP == 32:
        return col
    elif GROUP == 64:
        return 32 * (col % 2) + 2 * (col // 4) + (col // 2) % 2
    else:
        return 32 * ((col // 2) % 2 + 2 * (col % 2)) + 2 * (col // 8) + (col // 4) % 2


@triton.jit(do_not_specialize=["M", "split_k"])
def _w4a16_gemv_sliced_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, part_ptr, counters_ptr,
                              M, N, num_chunks, stride_xm, stride_qn, stride_sg, stride_zg, stride_om,
                              split_k, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                              HAS_PERM: tl.constexpr, ASM: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    n_mask = offs_n < N
    offs_w = tl.arange(0, 16)  # the 16 words of a 128-wide chunk
    NG: tl.constexpr = 128 // GROUP  # groups per chunk
    k_in_group = paired_group_channel(tl.arange(0, GROUP), GROUP)  # [G] each unpacked column's channel

    c_lo, c_hi = split_range(pid_k, num_chunks, split_k)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for c in range(c_lo, c_hi):
        qw = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (c * 16 + offs_w)[None, :],
                     mask=n_mask[:, None], other=0)  # [BN, 16] int32
        for gi in tl.static_range(NG):  # the chunk's groups
            g = c * NG + gi
            s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
            z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_mask, other=0).to(tl.float32) + 128.0
            k_idx = c * 128 + GROUP * gi + k_in_group  # [G]
            if HAS_PERM:
                k_idx = tl.load(perm_ptr + k_idx)
            w = paired_group_f32(qw, gi, GROUP, BLOCK_N, ASM)  # [BN, G] = 128 + q
            for m in tl.static_range(BLOCK_M):
                x = tl.load(x_ptr + m * stride_xm + k_idx, mask=(k_idx >= 0) & (m < M),
                            other=0.0).to(tl.float32)  # [G], gathered in the columns' order
                part = s * (tl.sum(w * x[None, :], axis=1) - z * tl.sum(x, axis=0))  # [BN]
                acc += tl.where(offs_m[None, :] == m, part[:, None], 0.0)
    store_tile(acc, out_ptr, part_ptr, counters_ptr, offs_n, offs_m, M, N, stride_om,
               pid_n, pid_k, split_k)


def w4a16_gemv(x2: torch.Tensor, w, out: torch.Tensor, block_n: int, split_k: int,
               num_warps: int, num_stages: int = 1, asm: bool | None = None) -> torch.Tensor:
    """out [M, N] = x2 [M, K] @ dequant(w)^T for M <= 4 (w: W4A16Weights; inputs checked
    by w4a16_gemm.w4a16_linear). asm: the one-lop3 nibble conversion (mask_or_f32); None: on a GPU,
    not under TRITON_INTERPRET."""
    m, k = x2.shape
    n = w.out_features
    if not 1 <= m <= 4:
        raise ValueError(f"w4a16_gemv: M must be 1..4, got {m}")
    steps = k // 128 if w.sliced else k // w.group_size  # chunks of 128 or groups along K
    tiles = triton.cdiv(n, block_n)
    split = max(1, min(split_k, steps))
    part, counters = splitk_buffers(split, m, n, tiles, w.splitk_counters, x2.device)
    perm = w.perm if w.perm is not None else w.qweight
    kernel = _w4a16_gemv_sliced_kernel if w.sliced else _w4a16_gemv_kernel
    kernel[(tiles, split)](
        x2, w.qweight, w.scales, w.zeros, perm, out, part, counters,
        m, n, steps, x2.stride(0), w.qweight.stride(0), w.scales.stride(0),
        w.zeros.stride(0), out.stride(0), split,
        GROUP=w.group_size, BLOCK_N=block_n, BLOCK_M=triton.next_power_of_2(m),
        HAS_PERM=w.perm is not None, ASM=paired_default() if asm is None else asm,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch(x2.device))
    return out
