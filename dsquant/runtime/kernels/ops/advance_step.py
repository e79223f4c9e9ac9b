"""One decode step on, in place: a multi-step burst's next inputs (runtime/engine/multi_step.py).

Layouts (the decode graphs' static buffers, cuda_graph.py), R rows, row i live when slot[i] >= 0:
  prev      [R] int64  the tokens the last step sampled (row i's next input id)
  input_ids [R] int64  <- prev on live rows
  positions [R] int64  += 1 on live rows
  seq_lens  [R] int32  += 1 on live rows
  slots     [R] int64  <- block_tables[i, p // BS] * BS + p % BS with p the new position, on live rows
  block_tables [R, W] int32, row stride stride_bt (unit column stride)
Padding rows (slot -1, seq_len 0) are left as they are, so they still store and attend to nothing.
One program of BLOCK rows: a single launch where torch would take about a dozen.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _advance_step_kernel(prev_ptr, ids_ptr, pos_ptr, lens_ptr, slot_ptr, bt_ptr, rows, stride_bt,
                         BS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    in_range = i < rows
    slot = tl.load(slot_ptr + i, mask=in_range, other=-1)
    live = in_range & (slot >= 0)
    pos = tl.load(pos_ptr + i, mask=live, other=0) + 1
    block = tl.load(bt_ptr + i.to(tl.int64) * stride_bt + pos // BS, mask=live, other=0).to(tl.int64)
    tl.store(ids_ptr + i, tl.load(prev_ptr + i, mask=live, other=0), mask=live)
    tl.store(pos_ptr + i, pos, mask=live)
    tl.store(lens_ptr + i, tl.load(lens_ptr + i, mask=live, other=0) + 1, mask=live)
    tl.store(slot_ptr + i, block * BS + pos % BS, mask=live)


def advance_step(prev: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                 slots: torch.Tensor, block_tables: torch.Tensor, block_size: int, kernel: bool | None = None) -> None:
    """The module's update of R rows, in place: the Triton kernel (kernel None: on CUDA), else torch."""
    rows = slots.shape[0]
    if not (slots.is_cuda if kernel is None else kernel):
        advance_step_reference(prev, input_ids, positions, seq_lens, slots, block_tables, block_size)
        return
    _advance_step_kernel[(1,)](prev, input_ids, positions, seq_lens, slots, block_tables, rows,
                               block_tables.stride(0), BS=block_size,
                               BLOCK=max(16, triton.next_power_of_2(rows)), num_warps=1)


def advance_step_reference(prev, input_ids, positions, seq_lens, slots, block_tables, block_size: int) -> None:
    """advance_step in torch ops, in place."""
    live = slots >= 0  # [R]
    input_ids.copy_(torch.where(live, prev, input_ids))
    positions += live
    seq_lens += live
    slots.copy_(torch.where(live, cache_slots(block_tables, positions, block_size), slots))


def cache_slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """block_tables [n, W] int32, positions [n] int64 -> the cache slot of each position [n] int64
    (a position past the table reads its last column: padding rows only)."""
    index = (positions // block_size)[:, None].clamp(max=block_tables.shape[1] - 1)
    return block_tables.gather(1, index)[:, 0].to(torch.int64) * block_size + positions % block_size
