"""Paged KV cache store: write new tokens' keys and values (GQA) or latent and rope key (MLA).

The cache of one layer is paged: `[num_blocks, block_size, ...]`, block_size 16, 32 or 64. A
sequence owns the blocks listed in its row of the block table; token t of this step goes to
slot_mapping[t] = block * block_size + offset, and slot -1 means "skip" (a padding token).

Layouts
- GQA / MHA: key, value [T, Hkv, D] (each token's [Hkv, D] contiguous; the token stride may be
  larger, e.g. a view into a fused qkv output); k_cache, v_cache [num_blocks, block_size, Hkv, D].
- MLA: kv_c [T, R] (R = kv_lora_rank, already RMS-normed), k_pe [T, P] (P = qk_rope_head_dim, rope
  applied); kv_cache [num_blocks, block_size, R + P]: the latent first, then the rope key.
- slot_mapping [T] int64.

One launch writes both halves: program (t, c) copies column tile c of token t's two rows.
Values are cast to the cache dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.errors import DsquantError

_BLOCK = 256


@triton.jit
def _store_two_rows_kernel(
    a_ptr, a_stride, a_dst_ptr, a_dst_stride, a_width,  # rows of a -> a_dst[slot]
    b_ptr, b_stride, b_dst_ptr, b_dst_stride, b_width,  # rows of b -> b_dst[slot]
    slot_ptr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        ma = cols < a_width
        xa = tl.load(a_ptr + t * a_stride + cols, mask=ma)
        tl.store(a_dst_ptr + slot * a_dst_stride + cols, xa.to(a_dst_ptr.dtype.element_ty), mask=ma)
        mb = cols < b_width
        xb = tl.load(b_ptr + t * b_stride + cols, mask=mb)
        tl.store(b_dst_ptr + slot * b_dst_stride + cols, xb.to(b_dst_ptr.dtype.element_ty), mask=mb)


def _rows(x: torch.Tensor, name: str, num_tokens: int, width: int) -> torch.Tensor:
    """x [T, ...] -> [T, width] view with unit column stride (copies only if it must)."""
    if x.shape[0] != num_tokens or x[0].numel() != width:
        raise DsquantError(f"{name}: expected {num_tokens} tokens of {width} values, got shape {tuple(x.shape)}")
    rows = x.reshape(num_tokens, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check_slots(slot_mapping: torch.Tensor, num_tokens: int) -> None:
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise DsquantError(f"slot_mapping: expected int64 [{num_tokens}], "
                           f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")


def _launch(a, a_dst, b, b_dst, slot_mapping) -> None:
    num_tokens = a.shape[0]
    if num_tokens == 0:
        return
    width = max(a.shape[1], b.shape[1])
    grid = (num_tokens, triton.cdiv(width, _BLOCK))
    _store_two_rows_kernel[grid](
        a, a.stride(0), a_dst, a_dst.stride(0), a.shape[1],
        b, b.stride(0), b_dst, b_dst.stride(0), b.shape[1],
        slot_mapping, BLOCK=_BLOCK,
    )


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key, value [T, Hkv, D] into k_cache, v_cache [num_blocks, block_size, Hkv, D] at their slots."""
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise DsquantError(f"k_cache/v_cache: expected two contiguous [num_blocks, block_size, Hkv, D] tensors, "
                           f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_tokens = key.shape[0]
    width = k_cache.shape[2] * k_cache.shape[3]  # Hkv * D
    _check_slots(slot_mapping, num_tokens)
    k_rows = _rows(key, "key", num_tokens, width)  # [T, Hkv*D]
    v_rows = _rows(value, "value", num_tokens, width)  # [T, Hkv*D]
    _launch(k_rows, k_cache.view(-1, width), v_rows, v_cache.view(-1, width), slot_mapping)


def store_latent(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write kv_c [T, R] and k_pe [T, P] into kv_cache [num_blocks, block_size, R + P] at their slots."""
    num_tokens = kv_c.shape[0]
    rank, rope = kv_c.shape[-1], k_pe.shape[-1]
    if kv_cache.dim() != 3 or kv_cache.shape[2] != rank + rope or not kv_cache.is_contiguous():
        raise DsquantError(f"kv_cache: expected contiguous [num_blocks, block_size, {rank} + {rope}], "
                           f"got {tuple(kv_cache.shape)}")
    _check_slots(slot_mapping, num_tokens)
    c_rows = _rows(kv_c, "kv_c", num_tokens, rank)  # [T, R]
    pe_rows = _rows(k_pe, "k_pe", num_tokens, rope)  # [T, P]
    flat = kv_cache.view(-1, rank + rope)  # [num_blocks * block_size, R + P]
    _launch(c_rows, flat[:, :rank], pe_rows, flat[:, rank:], slot_mapping)
