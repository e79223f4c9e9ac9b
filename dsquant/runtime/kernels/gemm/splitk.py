"""Tile order and split-K epilogue shared by the W4A16, FP8 and MoE GEMV kernels (`triton.jit` helpers).

`swizzled_tile` maps a program id to its (n-tile, m-tile): SWIZZLE consecutive n-tiles are visited
for every m-tile before moving on, so their weight columns stay in L2 across the m-tiles.

A tile's accumulator `acc` [BLOCK_N, BLOCK_M] fp32 holds out[m, n] for n = offs_n, m = offs_m
(the kernels compute the transposed product so the weight tile is the MMA's wide operand).
With split_k == 1 it is stored straight to out [M, N]. Otherwise each of the split_k programs of a
tile stores its partial into `part` [split_k, M, N] fp32, then bumps the tile's counter in
`counters` (int32, zero on entry); the program that arrives last sums the split_k partials in
split order (so the result does not depend on which program finished last), writes out and
resets the counter to zero, leaving the counters ready for the next launch. One launch, no
memset and no second reduction kernel: what a CUDA-graph decode step wants. split_k is a run-time
argument, so one compiled kernel serves every split factor. `reduce_splits` is that
protocol without the store, for kernels that apply their own epilogue to the reduced tile
(moe_gemv's gated SiLU-and-mul or routing weight).
"""
import torch
import triton
import triton.language as tl


SPLITK_COUNTER_SLOTS = 8192  # >= (N / 16) * (64 / 16) tiles for N up to 32768


def new_splitk_counters(device) -> torch.Tensor:
    """A layer's own counters for store_tile: int32 [SPLITK_COUNTER_SLOTS], zero (every launch
    leaves them zero, so a CUDA-graph replay needs no memset node)."""
    return torch.zeros(SPLITK_COUNTER_SLOTS, dtype=torch.int32, device=device)


def splitk_buffers(split: int, m: int, n: int, tiles: int, counters: torch.Tensor | None, device):
    """Host side of store_tile: (part fp32 [split, M, N], or a [1, 1, N] stub when split == 1;
    counters int32 with >= tiles zero slots: the given buffer if it is large enough, else new)."""
    part = torch.empty(split if split > 1 else 1, m if split > 1 else 1, n, dtype=torch.float32,
                       device=device)
    if counters is None or (split > 1 and counters.numel() < tiles):
        counters = torch.zeros(max(tiles, 1), dtype=torch.int32, device=device)
    return part, counters


@triton.jit
def swizzled_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWIZZLE: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_m = tl.cdiv(M, BLOCK_M)
    width = SWIZZLE * tiles_m
    first_n = (pid // width) * SWIZZLE
    size_n = tl.minimum(tiles_n - first_n, SWIZZLE)
    pid_n = first_n + (pid % width) % size_n
    pid_m = (pid % width) // size_n
    return pid_n, pid_m


@triton.jit
def split_range(pid_k, num_chunks, split_k):
    """K chunks [lo, hi) of split pid_k: ceil(num_chunks / split_k) each, the last ones shorter."""
    per_split = tl.cdiv(num_chunks, split_k)
    lo = pid_k * per_split
    return lo, tl.minimum(lo + per_split, num_chunks)


@triton.jit
def reduce_splits(acc, part_ptrs, mask, split_stride, counters_ptr, tile_id, pid_k, split_k):
    """One-launch split-K reduction of a tile (split_k > 1), for kernels with their own epilogue.

    acc: this program's fp32 partial (any shape); part_ptrs (acc's shape): where split 0 keeps the
    tile's partial, split s at part_ptrs + s * split_stride; mask: the tile's valid elements;
    counters_ptr + tile_id: the tile's int32 counter, zero on entry. Returns (last, total): last
    is true in exactly one program of the tile, the last to arrive, where total = the sum of the
    split_k partials in split order (deterministic) and the counter has been reset to zero; in the
    others total is zeros and must not be stored."""
    tl.store(part_ptrs + pid_k * split_stride, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the counter moves
    arrived = tl.atomic_add(counters_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
    last = arrived == split_k - 1
    total = tl.zeros_like(acc)
    if last:
        for s in range(split_k):
            total += tl.load(part_ptrs + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counters_ptr + tile_id, 0, sem="relaxed", scope="gpu")
    return last, total


@triton.jit
def store_tile(acc, out_ptr, part_ptr, counters_ptr, offs_n, offs_m, M, N, stride_om,
               tile_id, pid_k, split_k):
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)  # [BN, BM]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    if split_k == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = part_ptr + offs_m[None, :] * N + offs_n[:, None]  # [BN, BM] in one split's slice
        last, total = reduce_splits(acc, part, mask, M * N, counters_ptr, tile_id, pid_k, split_k)
        if last:
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
