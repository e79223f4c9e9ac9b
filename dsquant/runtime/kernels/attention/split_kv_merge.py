"""Split-KV decode: how many splits to use, and the log-sum-exp merge of the partial results.

A decode kernel that splits each sequence's context into S chunks writes, per (row b, head h,
split s), the chunk's softmax-normalised output and its log-sum-exp (base 2, scaled scores):
- partial_out [B, H, S, Dv] float32, partial_lse [B, H, S] float32 (-inf for an empty chunk).
The merge weighs each chunk by 2^(lse_s - max lse) and writes out [B, H, Dv] in out's dtype. An
empty chunk's partial_out is never read (the decode kernels do not store it), and the merge reads
partials in chunks of 8 splits only up to the last non-empty one. A row whose chunks
are all empty (seq_len 0, a padded batch row) gets zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl


@triton.jit
def store_split_result(out, m_i, l_i, b, heads, head_mask, cols, col_mask, live, split, num_heads, num_splits,
                       out_row_ptr, stride_oh, part_out_ptr, part_lse_ptr, WIDTH: tl.constexpr,
                       IS_SPLIT: tl.constexpr):
    """A decode program's result for rows `heads` of sequence b: out [ROWS, COLS] fp32 (normalized by l_i), m_i /
    l_i [ROWS] its running maximum and sum. One split: out's rows (out_row_ptr: sequence b's [H, WIDTH] in out's
    dtype, heads stride_oh apart). Several: partial_out and partial_lse at (b, heads, split) (module docstring);
    live: the chunk is non-empty (an empty one's partial_out is not written, its lse is -inf)."""
    mask = head_mask[:, None] & col_mask[None, :]
    if not IS_SPLIT:
        tl.store(out_row_ptr + heads[:, None] * stride_oh + cols[None, :], out.to(out_row_ptr.dtype.element_ty),
                 mask=mask)
    else:
        row_id = (b * num_heads + heads) * num_splits + split  # [ROWS]
        tl.store(part_out_ptr + row_id[:, None] * WIDTH + cols[None, :], out, mask=mask & live)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))  # empty chunk: -inf
        tl.store(part_lse_ptr + row_id, lse, mask=head_mask)


@triton.jit
def split_weights(part_lse_ptr, first, num_splits, BLOCK_S: tl.constexpr):
    """One row's splits (lse at part_lse_ptr + first + s): (m, total, live_end) = the largest lse (0
    when all are empty), sum over splits of 2^(lse - m) (empty ones weigh 0), and 1 + the index of
    the last non-empty split (most are empty when a graph captured for max_model_len replays a
    short context: split_bounds)."""
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(part_lse_ptr + first + s, mask=s < num_splits, other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    live_end = tl.max(tl.where(lse > float("-inf"), s + 1, 0), 0)
    return m, tl.sum(tl.exp2(lse - m), 0), live_end


@triton.jit
def sum_live_partials(part_out_ptr, part_lse_ptr, first, cols, col_mask, width, m, live_end,
                      CHUNK_S: tl.constexpr):
    """sum over splits s < live_end of part_out[first + s, cols] * 2^(lse_s - m) (fp32, cols' shape),
    CHUNK_S splits per load; part_out rows are `width` wide, empty splits are never read."""
    c = tl.arange(0, CHUNK_S)
    acc = tl.zeros(cols.shape, tl.float32)
    for s0 in range(0, live_end, CHUNK_S):
        sc = s0 + c  # [CHUNK_S]
        lse_c = tl.load(part_lse_ptr + first + sc, mask=sc < live_end, other=float("-inf"))
        part = tl.load(part_out_ptr + (first + sc)[:, None] * width + cols[None, :],
                       mask=(lse_c > float("-inf"))[:, None] & col_mask[None, :], other=0.0)  # [CHUNK_S, cols]
        acc += tl.sum(part * tl.exp2(lse_c - m)[:, None], 0)
    return acc


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr,  # [B, H, S, Dv], [B, H, S] float32, contiguous
    out_ptr, stride_ob, stride_oh,  # [B, H, Dv]
    num_heads, num_splits, head_dim_v,
    BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    first = (b * num_heads + h) * num_splits
    m, total, live_end = split_weights(part_lse_ptr, first, num_splits, BLOCK_S)
    dmask = d < head_dim_v
    acc = sum_live_partials(part_out_ptr, part_lse_ptr, first, d, dmask, head_dim_v, m, live_end, CHUNK_S)
    acc = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, acc.to(out_ptr.dtype.element_ty), mask=dmask)


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor) -> None:
    """partial_out [B, H, S, Dv], partial_lse [B, H, S] (float32, contiguous) -> out [B, H, Dv] (unit last stride)."""
    batch, heads, splits, dim_v = partial_out.shape
    block_d = min(128, triton.next_power_of_2(dim_v))
    grid = (batch, heads, triton.cdiv(dim_v, block_d))
    _merge_kernel[grid](partial_out, partial_lse, out, out.stride(0), out.stride(1),
                        heads, splits, dim_v, BLOCK_S=max(2, triton.next_power_of_2(splits)),
                        CHUNK_S=min(8, max(2, triton.next_power_of_2(splits))), BLOCK_D=block_d,
                        **pdl.launch(out.device))


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 132 (an H100/H200) elsewhere, so CPU runs pick like the GPU would."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def choose_num_splits(programs: int, max_seq_len: int, min_tokens: int, sms: int,
                      waves: int = 4, max_splits: int = 64) -> int:
    """Splits per sequence so that programs x splits fills about `waves` x sms, each split >= min_tokens.

    `programs` is the launch's program count without splitting (batch x head groups). Decode at
    large batch needs no split; one long sequence needs many. min_tokens bounds the cost of the
    partial results (written and read back once per split) against the keys a split reads.
    """
    if programs >= waves * sms:
        return 1
    wanted = triton.cdiv(waves * sms, programs)
    useful = max(1, max_seq_len // max(1, min_tokens))
    return max(1, min(wanted, useful, max_splits))


@triton.jit
def split_bounds(seq_len, split, num_splits, BLOCK_N: tl.constexpr, LONG_MIN: tl.constexpr,
                 MIN_TILES: tl.constexpr):
    """Tokens [start, end) of `split` in a sequence of seq_len tokens: each sequence divides its own
    length into chunks of at least MIN_TILES x BLOCK_N tokens (4 by default: a split's partial result
    costs about what reading that many keys does; fewer shortens a short context's chain of dependent
    tile loads), a multiple of BLOCK_N, over at most num_splits splits; the
    remaining splits are empty. LONG_MIN > 0: chunks of at least LONG_MIN tokens once the sequence
    has 64 of them (MLA's many-split launches at batch 1: a long context in fewer, longer splits).
    Sized in the kernel, not from the launch's max_seq_len, so a launch captured in a CUDA graph
    for max_model_len fits every context length it replays."""
    per = tl.maximum(tl.cdiv(seq_len, num_splits), MIN_TILES * BLOCK_N)
    if LONG_MIN > 0:
        per = tl.maximum(per, tl.minimum(LONG_MIN, tl.cdiv(seq_len, 64)))
    per = tl.cdiv(per, BLOCK_N) * BLOCK_N
    start = split * per
    return start, tl.minimum(seq_len, start + per)
