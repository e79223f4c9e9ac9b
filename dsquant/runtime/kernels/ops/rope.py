"""Rotary position embedding applied in place to query and key heads.

Layouts: q [T, Hq, R] and k [T, Hk, R] (views are fine, e.g. the rope slice of DeepSeek's
q [T, H, nope + R]; the last dimension must be contiguous), positions [T] int, and a cos/sin
cache cos, sin [max_pos, R/2] fp32 built by the caller (YaRN's inv_freq and its attention
factor baked in). With positions=None, cos and sin are already per token, [T, R/2] (row t is
token t's; the runtime's PagedContext holds them so). Pair i rotates by angle cos[p, i], sin[p, i]:
- "neox" layout: pair i is (x[i], x[i + R/2]); output in the same places (HF `rotate_half`).
- "interleaved" layout (DeepSeek): pair i is (x[2i], x[2i+1]). With `deinterleave=True` the
  output is written de-interleaved, rotated x[2i] to i and rotated x[2i+1] to i + R/2, exactly as
  transformers' `apply_rotary_pos_emb_interleave` (deepseek_v3) returns it; with False it stays
  in interleaved pairs, as deepseek_v2's complex `apply_rotary_emb` returns it.
Arithmetic is fp32, rounded once. One program per token, all heads of q and k.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LAYOUTS = ("neox", "interleaved")


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, token, heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  IN_INTERLEAVED: tl.constexpr, OUT_INTERLEAVED: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    i = tl.arange(0, HALF)[None, :]  # [1, HALF]
    mask = h < heads
    base = x_ptr + token * stride_t + h * stride_h
    if IN_INTERLEAVED:
        first = 2 * i
        second = 2 * i + 1
    else:
        first = i
        second = i + HALF
    x1 = tl.load(base + first, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, HALF]
    x2 = tl.load(base + second, mask=mask, other=0.0).to(tl.float32)
    # in place and de-interleaving: every load of this head set must land before any store
    tl.debug_barrier()
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if OUT_INTERLEAVED:
        out_first = 2 * i
        out_second = 2 * i + 1
    else:
        out_first = i
        out_second = i + HALF
    tl.store(base + out_first, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + out_second, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_heads, k_heads,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
                 HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                 IN_INTERLEAVED: tl.constexpr, OUT_INTERLEAVED: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    token = tl.program_id(0)
    if HAS_POSITIONS:
        pos = tl.load(pos_ptr + token).to(tl.int64)
    else:  # cos/sin rows are per token
        pos = token.to(tl.int64)
    i = tl.arange(0, HALF)[None, :]  # [1, HALF]
    cos = tl.load(cos_ptr + pos * stride_cache + i)
    sin = tl.load(sin_ptr + pos * stride_cache + i)
    _rotate_heads(q_ptr, stride_qt, stride_qh, token, q_heads, cos, sin, HALF, BLOCK_HQ,
                  IN_INTERLEAVED, OUT_INTERLEAVED)
    _rotate_heads(k_ptr, stride_kt, stride_kh, token, k_heads, cos, sin, HALF, BLOCK_HK,
                  IN_INTERLEAVED, OUT_INTERLEAVED)


def _check(name: str, x: torch.Tensor, t: int, rot: int) -> None:
    if x.dim() != 3 or x.shape[0] != t or x.shape[2] != rot:
        raise ValueError(f"{name} must be [T={t}, heads, R={rot}], got {tuple(x.shape)}")
    if x.stride(2) != 1:
        raise ValueError(f"{name} must be contiguous along its last (rotary) dimension")


def apply_rope(positions: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, layout: str = "neox", deinterleave: bool = True):
    """Rotate q [T, Hq, R] and k [T, Hk, R] in place by positions [T]; returns (q, k).

    cos, sin: fp32 [max_pos, R/2], or [T, R/2] per token when positions is None.
    layout: "neox" or "interleaved" (see module docstring).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"rope layout must be one of {LAYOUTS}, got {layout!r}")
    half = cos.shape[-1]
    t = positions.shape[0] if positions is not None else q.shape[0]
    if positions is None and cos.shape[0] != t:
        raise ValueError(f"without positions, cos/sin must be per token [T={t}, R/2], got {tuple(cos.shape)}")
    _check("q", q, t, 2 * half)
    _check("k", k, t, 2 * half)
    if cos.dtype != torch.float32 or sin.shape != cos.shape or sin.dtype != torch.float32:
        raise ValueError(f"cos/sin caches must both be fp32 [max_pos, R/2], got "
                         f"{cos.dtype} {tuple(cos.shape)} and {sin.dtype} {tuple(sin.shape)}")
    if half & (half - 1):
        raise ValueError(f"rotary dimension R/2 must be a power of two, got {half}")
    cos, sin = cos.contiguous(), sin.contiguous()
    interleaved = layout == "interleaved"
    if t:
        _rope_kernel[(t,)](
            positions if positions is not None else cos, q, k, cos, sin, q.shape[1], k.shape[1],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            HALF=half, BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            IN_INTERLEAVED=interleaved, OUT_INTERLEAVED=interleaved and not deinterleave,
            HAS_POSITIONS=positions is not None)
    return q, k
