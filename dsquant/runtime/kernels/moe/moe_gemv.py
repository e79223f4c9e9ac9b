"""INT4 expert GEMV for decode-sized MoE batches (a few (token, expert) pairs): no alignment, no MMA.

Pairs p = t * top_k + j come straight from topk_ids [T, top_k] (expert = topk_ids.flat[p]); no
moe_align pass. One program per (pair, BLOCK_N output channels, K split) walks its split's run of
128-channel tiles:
    out[p, n] = sum_k a[p // a_row_div, k] * W_e[n, k]
with the epilogues of moe_gemm: gated (w13 = gate rows [0, N) then up rows [N, 2N); out [P, N] =
silu(gate) * up, rounded as activation.silu_mul_as_reference) or routed (out [P, N] = acc *
topk_weights.flat[p]). Rows of `a` are bf16/fp16 with unit column stride; out [P, N] in a's dtype.
Weights: moe_gemm's "int4" layout (fused_moe_int4.py): qweight int32 [E, N/16, K/128, 16, 16],
where word i of row r in 128-channel tile t holds, in nibble j, channel 128t + 32 (j % 4) + 2i + j // 4
(the paired order); scales [E, K/G, N] (activation dtype), zeros uint8 [E, K/G, N]; act-order
experts: perm int32 [E, K], packed channel k reads a[p // a_row_div, perm[e, k]].
Per tile, nibble plane j is a [BLOCK_N, 16] block whose columns are every other channel of a
32-channel slice, so each thread multiplies the words it holds by a stride-2 slice of a, in fp32
FMAs, and keeps a [BLOCK_N, 16] running sum (one cross-thread reduction at the end). Codes become 128 + q by placing
them at bits 16..19 of fp32 128.0 (0x43000000, unit in the last place 2^-16); per group
    sum (q - z) s a = s * (sum (128 + q) a - (128 + z) * sum a).
Split-K: at decode the (pair, n-block) programs alone fill the GPU a fraction of the way and each
has few loads in flight; split_k programs per tile, each on ceil(tiles / split_k) K tiles, reduce
through splitk.reduce_splits (fp32 partials [split_k, P, 2 (gate, up) or 1, N], a counter per
(pair, n-block) in w.splitk_counters, the last program sums in split order and applies the
epilogue: `pair_epilogue`, shared with moe_gemv_fp8). The host helpers below (argument checks,
split choice, buffers) serve both GEMVs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.ops.activation import silu_mul_as_reference
from dsquant.runtime.kernels.moe.moe_gemm import GroupedWeight
from dsquant.runtime.kernels.moe.moe_int4_loop import _int4_tile
from dsquant.runtime.kernels.gemm.splitk import reduce_splits, split_range, splitk_buffers
from dsquant.runtime.kernels.gemm.w4a16_gemv import plane_f32
from dsquant.runtime.kernels.gemm.w4a16_mma import paired_default

MOE_GEMV_MAX_PAIRS = 16  # fused_moe takes the GEMV for at most this many (token, expert) pairs
# split-K rule: at least this many programs (about 10.6 one-warp programs per SM on 132 SMs), each
# split keeping >= 2 K tiles so the two-tile prefetch has work. From `dsquant bench moe --sweep
# int4 --sweep-tokens 1,2` on the H200 (2026-11-29, V2-Lite layer, block_n 16, 1 warp): T = 1
# (704 | 1024 programs unsplit) split 2 gave gate/up 17.6 us, down 10.5 (split 1: 21.2 | 12.9;
# 4: 19.1 | 11.1); T = 2 (1408 | 2048) split 1 was best (29.5 | 16.5; split 2: 30.9 | 18.5)
MOE_GEMV_TARGET_PROGRAMS = 1400


def effective_split(split_k: int, k_tiles: int) -> int:
    """The split factor a launch uses: split_k capped at k_tiles, then shrunk so no split is
    empty (11 tiles at split_k 8: 2 per split -> 6 splits)."""
    split = max(1, min(split_k, k_tiles))
    return triton.cdiv(k_tiles, triton.cdiv(k_tiles, split))


def default_split_k(pairs: int, n_out: int, k: int, block_n: int) -> int:
    """Split-K factor for one projection (MOE_GEMV_TARGET_PROGRAMS rule). V2-Lite at T = 1
    (8 pairs, block_n 16): gate/up 704 tiles x 16 K tiles -> 2; down 1024 x 11 -> 2; T = 2: 1."""
    programs = pairs * triton.cdiv(n_out, block_n)
    k_tiles = triton.cdiv(k, 128)
    want = -(-MOE_GEMV_TARGET_PROGRAMS // max(programs, 1))
    return effective_split(max(1, min(k_tiles // 2, want)), k_tiles)


def reserve_gemv_counters(w: GroupedWeight, n_out: int, pairs: int = MOE_GEMV_MAX_PAIRS) -> None:
    """Give w zeroed split-K counters for `pairs` pairs at the smallest block_n (8), at load
    time, so no launch (and no CUDA-graph capture) allocates them."""
    tiles = pairs * triton.cdiv(n_out, 8)
    c = w.splitk_counters
    if c is None or c.numel() < tiles or c.device != w.weight.device:
        w.splitk_counters = torch.zeros(tiles, dtype=torch.int32, device=w.weight.device)


def check_pair_gemv(name: str, a: torch.Tensor, w: GroupedWeight, topk_ids: torch.Tensor,
                    out: torch.Tensor, a_row_div: int, gated: bool, fmt: str) -> tuple[int, int]:
    """Validate a per-pair GEMV's arguments; returns (pairs, n_out)."""
    if w.format != fmt:
        raise ValueError(f"{name} needs {fmt} experts, got {w.format!r}")
    n_out = w.n // 2 if gated else w.n
    pairs = topk_ids.numel()
    if a.shape[1] != w.k or a.stride(1) != 1 or tuple(out.shape) != (pairs, n_out) or out.stride(1) != 1:
        raise ValueError(f"{name} shapes: a {tuple(a.shape)}, weight n={w.n} k={w.k}, "
                         f"out {tuple(out.shape)}, expected [{pairs}, {n_out}]")
    if a.shape[0] * a_row_div != pairs:
        raise ValueError(f"a has {a.shape[0]} rows; with a_row_div {a_row_div} it must cover {pairs} pairs")
    return pairs, n_out


def pair_launch(w: GroupedWeight, pairs: int, n_out: int, block_n: int, split_k: int | None,
                gated: bool, device):
    """(grid, split, part, counters) of a per-pair GEMV launch; split_k None: default_split_k."""
    if block_n < 8 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 8, got {block_n}")
    k_tiles = triton.cdiv(w.k, 128)
    if split_k is None:
        split_k = default_split_k(pairs, n_out, w.k, block_n)
    elif split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    split = effective_split(split_k, k_tiles)
    n_blocks = triton.cdiv(n_out, block_n)
    counters = w.splitk_counters
    if counters is not None and counters.device != torch.device(device):
        counters = None
    part, counters = splitk_buffers(split, pairs * (2 if gated else 1), n_out, pairs * n_blocks,
                                    counters, device)  # part [split, P * (2 or 1), N] fp32
    w.splitk_counters = counters  # allocated once, zero again after every launch
    return (pairs, n_blocks, split), split, part, counters


@triton.jit
def _store_pair(y, y_up, out_ptr, topk_w_ptr, pair, offs_n, n_mask, stride_om,
                GATED: tl.constexpr, ROUTED: tl.constexpr):
    """out[pair, offs_n] = silu(y) * y_up (GATED) or y, times topk_weights[pair] (ROUTED)."""
    if GATED:
        y = silu_mul_as_reference(y, y_up, out_ptr.dtype.element_ty)
    if ROUTED:
        y = y * tl.load(topk_w_ptr + pair)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def pair_epilogue(y, y_up, out_ptr, part_ptr, counters_ptr, topk_w_ptr, pair, pid_n, pid_k, split_k,
                  offs_n, N, stride_om, GATED: tl.constexpr, ROUTED: tl.constexpr):
    """Finish a (pair, n-block) tile from this program's fp32 sums y (the gate when GATED) and
    y_up [BN] over its K range: stored directly at split_k == 1, else reduced over the splits
    (part fp32 [split_k, P, 2 or 1, N], counter pair * n_blocks + pid_n) by the last program."""
    n_mask = offs_n < N
    if split_k == 1:
        _store_pair(y, y_up, out_ptr, topk_w_ptr, pair, offs_n, n_mask, stride_om, GATED, ROUTED)
    else:
        tile = pair * tl.num_programs(1) + pid_n
        if GATED:  # gate and up partials side by side: [BN, 2], rows 2p (gate) and 2p + 1 (up)
            ptrs = part_ptr + (2 * pair + tl.arange(0, 2))[None, :] * N + offs_n[:, None]
            last, total = reduce_splits(tl.join(y, y_up), ptrs, n_mask[:, None],
                                        tl.num_programs(0) * 2 * N, counters_ptr, tile, pid_k, split_k)
            gate, up = tl.split(total)
        else:
            last, gate = reduce_splits(y, part_ptr + pair * N + offs_n, n_mask, tl.num_programs(0) * N,
                                       counters_ptr, tile, pid_k, split_k)
            up = gate
        if last:
            _store_pair(gate, up, out_ptr, topk_w_ptr, pair, offs_n, n_mask, stride_om, GATED, ROUTED)


@triton.jit
def _tile_dot(acc, packed, a_ptr, a_off, k0, s_ptr, z_ptr, s_off, n_mask, stride_s1, pe,
              GROUP: tl.constexpr, ASM: tl.constexpr = False, HAS_PERM: tl.constexpr = False):
    """acc [BN, 16] += scaled partial sums of one 128-channel tile (packed [BN, 16] words, paired
    order: nibble plane j is channels 32 (j % 4) + j // 4 + 2i, i = 0..15); HAS_PERM: packed channel
    k meets a[pe[k]] (the expert's act-order channel order)."""
    SLICES: tl.constexpr = GROUP // 32  # 32-channel slices (nibble planes j and j + 4) per group
    i = tl.arange(0, 16)
    high = packed >> 16  # [BN, 16]
    for gi in tl.static_range(4 // SLICES):
        part = tl.zeros_like(acc)  # [BN, 16]
        a_sum = tl.zeros([16], dtype=tl.float32)
        for jj in tl.static_range(SLICES):
            for h in tl.static_range(2):
                k_idx = k0 + 32 * (gi * SLICES + jj) + h + 2 * i  # [16]
                if HAS_PERM:
                    k_idx = tl.load(pe + k_idx)
                a_j = tl.load(a_ptr + a_off + k_idx).to(tl.float32)  # [16]
                part += plane_f32(packed, high, gi * SLICES + jj + 4 * h, ASM) * a_j[None, :]
                a_sum += a_j
        g = (k0 + 32 * gi * SLICES) // GROUP
        s = tl.load(s_ptr + s_off + g * stride_s1, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
        z = tl.load(z_ptr + s_off + g * stride_s1, mask=n_mask, other=0).to(tl.float32) + 128.0
        acc += s[:, None] * (part - z[:, None] * a_sum[None, :])
    return acc


@triton.jit(do_not_specialize=["split_k"])  # one compile for every split factor
def _moe_gemv_kernel(a_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, counters_ptr, topk_w_ptr, ids_ptr, perm_ptr,
                     N, K, a_row_div, stride_am, stride_we, stride_wc, stride_se, stride_s1, stride_s2,
                     stride_om, stride_pe, split_k, GROUP: tl.constexpr, GATED: tl.constexpr, ROUTED: tl.constexpr,
                     BLOCK_N: tl.constexpr, LOADS_ONLY: tl.constexpr = False, ASM: tl.constexpr = False,
                     PDL: tl.constexpr = False, EARLY_IDS: tl.constexpr = False, HAS_PERM: tl.constexpr = False):
    """Grid (P, cdiv(N, BLOCK_N), split_k); a [rows, K], qweight/scales/zeros, out [P, N] and
    part fp32 [split_k, P, 2 or 1, N] as in the module docstring; K % 128 == 0.
    LOADS_ONLY (scripts/moe_gemv_probe.py only; the output is not a product): the same weight loads,
    each word folded into acc by one add instead of dequantized, no activation / scale / zero loads:
    the kernel's time without its dequantization and dot.
    PDL (pdl.py): EARLY_IDS (ids written two or more launches earlier, as for the down projection
    right after the gate/up one) reads the ids and the first two weight tiles before the wait; else
    the wait comes first."""
    if not EARLY_IDS:
        pdl.enter(PDL)
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    here = expert >= 0  # a negative id: the expert is on another rank; no weight is read, the sums stay 0
    expert = tl.maximum(expert, 0)
    a_off = (pair // a_row_div).to(tl.int64) * stride_am
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = (offs_n < N) & here
    s_off = expert * stride_se + offs_n * stride_s2  # [BN]
    pe = perm_ptr + expert * stride_pe  # act-order channel order (read only under HAS_PERM)
    t_lo, t_hi = split_range(pid_k, K // 128, split_k)
    k_lo = t_lo * 128
    k_hi = t_hi * 128  # this split's channels [k_lo, k_hi)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    # tiles k0 and k0 + 128 are in flight while k0 is computed (few programs per SM at decode:
    # the loads, not the FMAs, set the pace); up rows are N further down the same expert
    m0 = n_mask & (k_lo < k_hi)
    m1 = n_mask & (k_lo + 128 < k_hi)
    p0 = _int4_tile(w_ptr, expert, offs_n, m0, k_lo, stride_we, stride_wc)  # [BN, 16]
    p1 = _int4_tile(w_ptr, expert, offs_n, m1, k_lo + 128, stride_we, stride_wc)
    if GATED:
        u0 = _int4_tile(w_ptr, expert, offs_n + N, m0, k_lo, stride_we, stride_wc)
        u1 = _int4_tile(w_ptr, expert, offs_n + N, m1, k_lo + 128, stride_we, stride_wc)
    if EARLY_IDS:
        pdl.enter(PDL)
    for k0 in range(k_lo, k_hi, 128):
        ahead = n_mask & (k0 + 256 < k_hi)
        p2 = _int4_tile(w_ptr, expert, offs_n, ahead, k0 + 256, stride_we, stride_wc)
        if LOADS_ONLY:
            acc += p0.to(tl.float32)
        else:
            acc = _tile_dot(acc, p0, a_ptr, a_off, k0, s_ptr, z_ptr, s_off, n_mask, stride_s1, pe, GROUP, ASM,
                            HAS_PERM)
        p0 = p1
        p1 = p2
        if GATED:
            u2 = _int4_tile(w_ptr, expert, offs_n + N, ahead, k0 + 256, stride_we, stride_wc)
            if LOADS_ONLY:
                acc_up += u0.to(tl.float32)
            else:
                acc_up = _tile_dot(acc_up, u0, a_ptr, a_off, k0, s_ptr, z_ptr, s_off + N * stride_s2,
                                   n_mask, stride_s1, pe, GROUP, ASM, HAS_PERM)
            u0 = u1
            u1 = u2
    y = tl.sum(acc, axis=1)  # [BN]
    y_up = y
    if GATED:
        y_up = tl.sum(acc_up, axis=1)
    pair_epilogue(y, y_up, out_ptr, part_ptr, counters_ptr, topk_w_ptr, pair, pid_n, pid_k, split_k,
                  offs_n, N, stride_om, GATED, ROUTED)


def moe_gemv_int4(a: torch.Tensor, w: GroupedWeight, topk_ids: torch.Tensor, out: torch.Tensor,
                  a_row_div: int, gated: bool, topk_weights: torch.Tensor | None = None,
                  block_n: int = 32, num_warps: int = 2, split_k: int | None = None,
                  _loads_only: bool = False, _asm: bool | None = None, early_ids: bool = False) -> torch.Tensor:
    """out [P, N or N/2 when gated] for the P = topk_ids.numel() pairs (see module docstring).
    split_k None: default_split_k; counters come from (and stay zero in) w.splitk_counters.
    _loads_only: the kernel's LOADS_ONLY timing variant (scripts/moe_gemv_probe.py); out is not a product.
    _asm: the one-lop3 nibble conversion (None: on a GPU, not under TRITON_INTERPRET); False for the probe's A/B.
    early_ids: topk_ids were written two or more launches before this one (the kernel's EARLY_IDS)."""
    pairs, n_out = check_pair_gemv("moe_gemv_int4", a, w, topk_ids, out, a_row_div, gated, "int4")
    if pairs == 0:
        return out
    ids = topk_ids.reshape(-1)
    tw = topk_weights.reshape(-1).float() if topk_weights is not None else a
    grid, split, part, counters = pair_launch(w, pairs, n_out, block_n, split_k, gated, a.device)
    perm = w.perm if w.perm is not None else ids  # a stub pointer without act-order
    _moe_gemv_kernel[grid](a, w.weight, w.scales, w.zeros, out, part, counters, tw, ids, perm, n_out, w.k,
                           a_row_div, a.stride(0), w.weight.stride(0), w.weight.stride(1),
                           w.scales.stride(0), w.scales.stride(1), w.scales.stride(2), out.stride(0),
                           perm.stride(0), split, GROUP=w.group_size, GATED=gated, HAS_PERM=w.perm is not None,
                           ROUTED=topk_weights is not None,
                           BLOCK_N=block_n, LOADS_ONLY=_loads_only, ASM=paired_default() if _asm is None else _asm,
                           EARLY_IDS=early_ids, num_warps=num_warps, **pdl.launch(a.device))
    return out
