"""Row argmax of logits in two stages (greedy sampling over a large vocabulary).

Layouts: logits [S, V] bf16/fp16/fp32, last dimension contiguous (rows may be strided);
out [S] int64. Stage 1, grid (S, C) with C = cdiv(V, BLOCK): each program reduces one BLOCK-wide
chunk of a row to (max value, first index of it) in part_val [S, C] fp32 / part_idx [S, C] int32.
Stage 2, grid (S,): reduces a row's C partials the same way. Values are compared in fp32, which
holds bf16/fp16 exactly. torch.argmax's rules are kept: ties go to the lowest index, and NaN counts
as larger than everything, so a row holding NaN gives the index of its first NaN. With a
vocabulary of 102400 and BLOCK 2048, stage 1 runs 50 programs per row instead of torch's one
block per row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl

BIG = tl.constexpr(2**31 - 1)  # an index past any vocabulary


@triton.jit
def _reduce(val, idx, mask):
    """(max, first index of max) of val [N] fp32 at indices idx [N] int32; a NaN wins, first NaN first."""
    is_nan = (val != val) & mask
    nan_idx = tl.min(tl.where(is_nan, idx, BIG), axis=0)
    key = tl.where(mask & ~is_nan, val, float("-inf"))
    best = tl.max(key, axis=0)
    best_idx = tl.min(tl.where(mask & (key == best), idx, BIG), axis=0)
    has_nan = nan_idx < BIG
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, nan_idx, best_idx)


@triton.jit
def _argmax_chunks_kernel(x_ptr, part_val_ptr, part_idx_ptr, vocab, stride_x, num_chunks,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < vocab
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
    best, best_idx = _reduce(x, cols, mask)
    tl.store(part_val_ptr + row * num_chunks + chunk, best)
    tl.store(part_idx_ptr + row * num_chunks + chunk, best_idx)


@triton.jit
def _argmax_merge_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)  # [BLOCK_C]
    mask = c < num_chunks
    val = tl.load(part_val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * num_chunks + c, mask=mask, other=BIG)
    # chunks are in index order and each holds its first best index, so the least index wins ties
    _, best_idx = _reduce(val, idx, mask)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


def argmax(logits: torch.Tensor, block: int = 2048, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [S, V] -> [S] int64 (into `out` when given), the first index of each row's maximum
    (NaN: the first NaN)."""
    if logits.dim() != 2:
        raise ValueError(f"argmax expects logits [S, V], got shape {tuple(logits.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, block)
    part_val = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)  # [S, C]
    part_idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)  # [S, C]
    _argmax_chunks_kernel[(rows, chunks)](logits, part_val, part_idx, vocab, logits.stride(0), chunks,
                                          BLOCK=block, num_warps=4, **pdl.launch(logits.device))
    _argmax_merge_kernel[(rows,)](part_val, part_idx, out, chunks,
                                  BLOCK_C=max(16, triton.next_power_of_2(chunks)), num_warps=1,
                                  **pdl.launch(out.device))
    return out
