"""FP8 paged KV cache store: quantize the new tokens' keys and values (GQA) or latent (MLA) to e4m3
with a dynamic scale per group, in registers, and write them with their scales at their slots.

Numbers and layouts as kv_fp8_layout.py (whose torch functions are this kernel's reference):
scale = max(amax, MIN_AMAX) / 448 over a group, q = e4m3(clamp(x / scale, -448, 448)), the division
IEEE-rounded (div_rn) as torch's.
- GQA: key, value [T, Hkv, D] (each token's [Hkv, D] contiguous, any token stride); k_cache,
  v_cache float8_e4m3fn [num_blocks, block_size, Hkv, D]; k_scale, v_scale float32
  [num_blocks, block_size, Hkv]: one scale per token and kv head. Program (t, head tile).
- MLA: kv_c [T, R], k_pe [T, P]; the uint8 cache [num_blocks, block_size, R + 4R/128 + 2P] through
  its three views (latent e4m3, scales fp32, rope bf16/fp16). One program per token.
- slot_mapping [T] int64; slot -1 is skipped (a padding token).
Under TRITON_INTERPRET the cast to e4m3 is not faithful: these kernels are tested on a GPU only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.errors import DsquantError
from dsquant.runtime.kernels.attention.kv_fp8_layout import FP8_DTYPE, FP8_MAX, MIN_AMAX, MLA_GROUP, mla_fp8_views
from dsquant.runtime.kernels.attention.kv_store import _check_slots, _rows

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@triton.jit
def _quantize_rows(x):
    """x [M, N] fp32 (masked entries 0) -> (x / scale clamped to +-448, scale [M]), one scale per row."""
    amax = tl.max(tl.abs(x), 1)
    # div_rn does not broadcast: both operands at full shape
    scale = tl.math.div_rn(tl.maximum(amax, _MIN_AMAX), tl.zeros_like(amax) + _FP8_MAX)  # [M]
    q = tl.math.div_rn(x, scale[:, None] + tl.zeros_like(x))
    return tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX), scale


@triton.jit
def _store_kv_fp8_kernel(
    k_ptr, v_ptr, stride_kt, stride_vt,  # key, value [T, Hkv, D]
    kc_ptr, vc_ptr, ks_ptr, vs_ptr,  # caches as [slots, Hkv, D] e4m3, scales as [slots, Hkv] fp32
    slot_ptr, num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        hmask = h < num_kv_heads
        mask = hmask[:, None] & (d < HEAD_DIM)[None, :]
        src = h[:, None] * HEAD_DIM + d[None, :]  # [BLOCK_H, BLOCK_D]
        dst = slot * num_kv_heads * HEAD_DIM + src
        k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + src, mask=mask, other=0.0).to(tl.float32)
        qk, sk = _quantize_rows(k)
        tl.store(kc_ptr + dst, qk.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(ks_ptr + slot * num_kv_heads + h, sk, mask=hmask)
        v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + src, mask=mask, other=0.0).to(tl.float32)
        qv, sv = _quantize_rows(v)
        tl.store(vc_ptr + dst, qv.to(vc_ptr.dtype.element_ty), mask=mask)
        tl.store(vs_ptr + slot * num_kv_heads + h, sv, mask=hmask)


@triton.jit
def _store_latent_fp8_kernel(
    c_ptr, stride_ct, pe_ptr, stride_pt,  # kv_c [T, R], k_pe [T, P]
    lat_ptr, stride_lat, sc_ptr, stride_sc, rope_ptr, stride_rope,  # cache views, per-slot strides
    slot_ptr,
    GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, GROUP: tl.constexpr, ROPE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        g = tl.arange(0, BLOCK_G)
        gmask = g < GROUPS
        cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_G, GROUP]
        x = tl.load(c_ptr + t.to(tl.int64) * stride_ct + cols, mask=gmask[:, None], other=0.0).to(tl.float32)
        q, scale = _quantize_rows(x)
        tl.store(lat_ptr + slot * stride_lat + cols, q.to(lat_ptr.dtype.element_ty), mask=gmask[:, None])
        tl.store(sc_ptr + slot * stride_sc + g, scale, mask=gmask)
        p = tl.arange(0, ROPE)
        pe = tl.load(pe_ptr + t.to(tl.int64) * stride_pt + p)
        tl.store(rope_ptr + slot * stride_rope + p, pe.to(rope_ptr.dtype.element_ty))


def store_kv_fp8(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize key, value [T, Hkv, D] into the e4m3 caches [num_blocks, block_size, Hkv, D] and their
    scales [num_blocks, block_size, Hkv] at their slots."""
    shape = k_cache.shape
    if (k_cache.dtype != FP8_DTYPE or v_cache.dtype != FP8_DTYPE or v_cache.shape != shape or len(shape) != 4
            or k_scale.shape != shape[:3] or v_scale.shape != shape[:3] or k_scale.dtype != torch.float32
            or v_scale.dtype != torch.float32
            or not all(x.is_contiguous() for x in (k_cache, v_cache, k_scale, v_scale))):
        raise DsquantError(f"store_kv_fp8: expected contiguous e4m3 caches [num_blocks, block_size, Hkv, D] and fp32 "
                           f"scales [num_blocks, block_size, Hkv], got {k_cache.dtype} {tuple(shape)}, "
                           f"{v_cache.dtype} {tuple(v_cache.shape)}, {tuple(k_scale.shape)}, {tuple(v_scale.shape)}")
    num_tokens, hkv, dim = key.shape[0], shape[2], shape[3]
    _check_slots(slot_mapping, num_tokens)
    k_rows = _rows(key, "key", num_tokens, hkv * dim)  # [T, Hkv*D]
    v_rows = _rows(value, "value", num_tokens, hkv * dim)
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(dim)
    block_h = max(2, min(triton.next_power_of_2(hkv), 4096 // block_d))
    _store_kv_fp8_kernel[(num_tokens, triton.cdiv(hkv, block_h))](
        k_rows, v_rows, k_rows.stride(0), v_rows.stride(0), k_cache, v_cache, k_scale, v_scale,
        slot_mapping, hkv, HEAD_DIM=dim, BLOCK_H=block_h, BLOCK_D=block_d)


def store_latent_fp8(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, rope_dtype: torch.dtype) -> None:
    """Quantize kv_c [T, R] and write it with k_pe [T, P] into the uint8 MLA FP8 cache at their slots."""
    num_tokens, rank = kv_c.shape[0], kv_c.shape[-1]
    rope = k_pe.shape[-1]
    if kv_cache.dim() != 3 or not kv_cache.is_contiguous():
        raise DsquantError(f"store_latent_fp8: expected a contiguous uint8 [num_blocks, block_size, W], "
                           f"got {tuple(kv_cache.shape)}")
    try:
        latent, scales, pe = mla_fp8_views(kv_cache, rank, rope, rope_dtype)
    except ValueError as e:
        raise DsquantError(f"store_latent_fp8: {e}") from None
    _check_slots(slot_mapping, num_tokens)
    c_rows = _rows(kv_c, "kv_c", num_tokens, rank)  # [T, R]
    pe_rows = _rows(k_pe, "k_pe", num_tokens, rope)  # [T, P]
    if rope & (rope - 1):
        raise DsquantError(f"store_latent_fp8: qk_rope_head_dim {rope} must be a power of two")
    if num_tokens == 0:
        return
    groups = scales.shape[-1]
    _store_latent_fp8_kernel[(num_tokens,)](
        c_rows, c_rows.stride(0), pe_rows, pe_rows.stride(0),
        latent, latent.stride(1), scales, scales.stride(1), pe, pe.stride(1), slot_mapping,
        GROUPS=groups, BLOCK_G=max(2, triton.next_power_of_2(groups)), GROUP=MLA_GROUP, ROPE=rope)
