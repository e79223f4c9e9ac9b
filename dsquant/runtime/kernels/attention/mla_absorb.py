"""The two launches around absorbed MLA attention (mla_decode.py): everything between the
projections and the attention kernel in one, the split merge and W_UV in the other.

`mla_prepare` (one launch) replaces the q rope, the kv_a RMSNorm, the k rope, the latent cache store
and the W_UK absorption einsum:
- q [T, H, nope + P]: the q projection's output (any token/head strides, unit last stride). Its rope
  part q[..., nope:] is rotated in place; q_nope is read.
- q_abs[t, h] = q_nope[t, h] @ W_UK[h]  -> q_abs [T, H, R] (q's dtype; fp32 accumulation, as the
  einsum it replaces).
- latent [T, R + P]: the kv_a projection's output. kv_cache[slot[t]] = [rms_norm(latent[t, :R]) *
  norm_weight ; rope(latent[t, R:])] (slot -1: skipped). The norm rounds as runtime/kernels/ops/rmsnorm.py
  (normalised value rounded to the activation dtype before the weight multiply).
- cos, sin [T, P/2] fp32, per token. Rope layouts as runtime/kernels/ops/rope.py: "interleaved" input
  pairs (2i, 2i+1) or "neox" pairs (i, i + P/2); the output is always de-interleaved (i, i + P/2).
- w_uk [H, nope, R] contiguous; kv_cache [num_blocks, block_size, R + P] contiguous.
Program (token block, p): p < H * R/BLOCK_R computes the q_abs tile of head p // (R/BLOCK_R) (and,
for its first R tile, that head's q rope); the last program of each token block does the latent.

`mla_merge_uv` (one launch) replaces the split-KV merge and the W_UV einsum:
- part_out [T, H, S, R], part_lse [T, H, S] fp32 from mla_decode (split layout), w_uv [H, v, R]
  -> out [T, H, v]: the merged latent output (rounded to out's dtype, as the merge wrote it) times
  W_UV[h]^T, fp32 accumulation. Program (token, head, v tile); a split with lse -inf (empty) is not
  read. Decode-sized T only: every program reads its own W_UV tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.errors import DsquantError
from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.attention.split_kv_merge import split_weights, sum_live_partials


@triton.jit
def _rope_rows(src_ptr, dst_ptr, src_row, dst_row, mask, cos, sin,
               HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Rotate rows (pointer offsets src_row/dst_row [BLOCK_T, 1]) of 2*HALF values; out de-interleaved."""
    i = tl.arange(0, HALF)[None, :]  # [1, HALF]
    if INTERLEAVED:
        x1 = tl.load(src_ptr + src_row + 2 * i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src_ptr + src_row + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(src_ptr + src_row + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src_ptr + src_row + i + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.debug_barrier()  # in place: every load lands before any store
    tl.store(dst_ptr + dst_row + i, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_ptr + dst_row + i + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mla_prepare_kernel(
    q_ptr, stride_qt, stride_qh,  # q [T, H, NOPE + ROPE]
    w_uk_ptr,  # [H, NOPE, RANK]
    q_abs_ptr,  # [T, H, RANK]
    lat_ptr, stride_lt,  # latent [T, RANK + ROPE]
    norm_w_ptr, eps,  # [RANK]
    cos_ptr, sin_ptr, stride_cs,  # [T, ROPE / 2] fp32
    cache_ptr, slot_ptr,  # kv_cache as [slots, RANK + ROPE], slot_mapping [T] int64
    num_tokens, num_heads,
    NOPE: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr = False,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    tmask = t < num_tokens
    p = tl.program_id(1)
    r_tiles: tl.constexpr = RANK // BLOCK_R
    half: tl.constexpr = ROPE // 2
    is_q = p < num_heads * r_tiles
    h = tl.minimum(p // r_tiles, num_heads - 1)
    r = (p % r_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    n = tl.arange(0, NOPE)
    # W_UK is a weight: read before the PDL wait (pdl.py rule 1); the latent program reads none
    w_uk = tl.load(w_uk_ptr + (h * NOPE + n[:, None]) * RANK + r[None, :], mask=is_q, other=0.0)  # [NOPE, BLOCK_R]
    pdl.enter(PDL)
    hi = tl.arange(0, half)[None, :]
    cos = tl.load(cos_ptr + t[:, None] * stride_cs + hi, mask=tmask[:, None], other=0.0)  # [BLOCK_T, half]
    sin = tl.load(sin_ptr + t[:, None] * stride_cs + hi, mask=tmask[:, None], other=0.0)
    if is_q:
        q_row = t[:, None].to(tl.int64) * stride_qt + h * stride_qh  # [BLOCK_T, 1]
        q_nope = tl.load(q_ptr + q_row + n[None, :], mask=tmask[:, None], other=0.0)  # [BLOCK_T, NOPE]
        acc = tl.dot(q_nope, w_uk)  # [BLOCK_T, BLOCK_R] fp32
        out_row = (t[:, None].to(tl.int64) * num_heads + h) * RANK
        tl.store(q_abs_ptr + out_row + r[None, :], acc.to(q_abs_ptr.dtype.element_ty), mask=tmask[:, None])
        if p % r_tiles == 0:
            _rope_rows(q_ptr, q_ptr, q_row + NOPE, q_row + NOPE, tmask[:, None], cos, sin, half, INTERLEAVED)
    else:
        slot = tl.load(slot_ptr + t, mask=tmask, other=-1)  # [BLOCK_T]
        keep = (slot >= 0)[:, None]
        lat_row = t[:, None].to(tl.int64) * stride_lt
        dst_row = slot[:, None] * (RANK + ROPE)
        c = tl.arange(0, RANK)[None, :]
        x = tl.load(lat_ptr + lat_row + c, mask=tmask[:, None], other=0.0).to(tl.float32)  # [BLOCK_T, RANK]
        var = tl.sum(x * x, axis=1) / RANK
        normed = (x * tl.rsqrt(var + eps)[:, None]).to(lat_ptr.dtype.element_ty).to(tl.float32)
        gamma = tl.load(norm_w_ptr + c).to(tl.float32)
        normed = (normed * gamma).to(lat_ptr.dtype.element_ty)
        tl.store(cache_ptr + dst_row + c, normed.to(cache_ptr.dtype.element_ty), mask=keep)
        _rope_rows(lat_ptr, cache_ptr, lat_row + RANK, dst_row + RANK, keep, cos, sin, half, INTERLEAVED)


def mla_prepare(q: torch.Tensor, latent: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                cos: torch.Tensor, sin: torch.Tensor, w_uk: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """q [T, H, nope + P] (rope part rotated in place), latent [T, R + P] -> q_abs [T, H, R];
    stores the token's normed latent and rotated rope key in kv_cache (module docstring)."""
    t, heads, width = q.shape
    nope, rank = w_uk.shape[1], w_uk.shape[2]
    rope = width - nope
    if w_uk.shape[0] != heads or not w_uk.is_contiguous():
        raise DsquantError(f"mla_prepare: w_uk must be contiguous [H={heads}, nope, R], got {tuple(w_uk.shape)}")
    if latent.shape != (t, rank + rope) or latent.stride(-1) != 1 or q.stride(-1) != 1:
        raise DsquantError(f"mla_prepare: latent must be [T={t}, R + P = {rank + rope}] and q [T, H, nope + P], "
                           f"unit last strides; got {tuple(latent.shape)}, {tuple(q.shape)}")
    if kv_cache.shape[-1] != rank + rope or not kv_cache.is_contiguous():
        raise DsquantError(f"mla_prepare: kv_cache must be contiguous [blocks, block_size, {rank + rope}], "
                           f"got {tuple(kv_cache.shape)}")
    if cos.shape != (t, rope // 2) or cos.dtype != torch.float32 or sin.shape != cos.shape:
        raise DsquantError(f"mla_prepare: cos/sin must be fp32 [T={t}, {rope // 2}], got {tuple(cos.shape)}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (t,):
        raise DsquantError(f"mla_prepare: slot_mapping must be int64 [{t}], got {slot_mapping.dtype} "
                           f"{tuple(slot_mapping.shape)}")
    q_abs = torch.empty(t, heads, rank, dtype=q.dtype, device=q.device)
    if t == 0:
        return q_abs
    block_t = 16 if t <= 16 else 64
    block_r = min(128, rank)
    cos, sin = cos.contiguous(), sin.contiguous()
    grid = (triton.cdiv(t, block_t), heads * (rank // block_r) + 1)
    _mla_prepare_kernel[grid](
        q, q.stride(0), q.stride(1), w_uk, q_abs, latent, latent.stride(0), norm_weight, eps,
        cos, sin, cos.stride(0), kv_cache, slot_mapping, t, heads,
        NOPE=nope, RANK=rank, ROPE=rope, BLOCK_T=block_t, BLOCK_R=block_r, INTERLEAVED=interleaved,
        num_warps=4 if block_t == 16 else 8, **pdl.launch(q.device))
    return q_abs


@triton.jit
def _mla_merge_uv_kernel(
    part_out_ptr, part_lse_ptr,  # [T, H, S, RANK], [T, H, S] fp32
    w_uv_ptr,  # [H, V, RANK]
    out_ptr, stride_ot, stride_oh,  # [T, H, V]
    num_heads, num_splits, v_dim,
    RANK: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr, PDL: tl.constexpr = False,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    vmask = v < v_dim
    # W_UV is a weight: its first tile (all of it when BLOCK_R == RANK) is read before the PDL wait
    w_rows = w_uv_ptr + (h * v_dim + v[:, None]) * RANK  # [BLOCK_V, 1]
    r_first = tl.arange(0, BLOCK_R)
    w_first = tl.load(w_rows + r_first[None, :], mask=vmask[:, None] & (r_first < RANK)[None, :],
                      other=0.0)  # [BLOCK_V, BLOCK_R]
    pdl.enter(PDL)
    row = (t.to(tl.int64) * num_heads + h) * num_splits
    m, total, live_end = split_weights(part_lse_ptr, row, num_splits, BLOCK_S)
    inv = 1.0 / tl.where(total > 0, total, 1.0)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for r0 in tl.static_range(0, RANK, BLOCK_R):  # unrolled: every tile's loads can be in flight at once
        r = r0 + tl.arange(0, BLOCK_R)
        merged = sum_live_partials(part_out_ptr, part_lse_ptr, row, r, r < RANK, RANK, m, live_end, CHUNK_S)
        latent = (merged * inv).to(w_uv_ptr.dtype.element_ty).to(tl.float32)  # [BLOCK_R]
        if r0 == 0:
            w_uv = w_first.to(tl.float32)
        else:
            w_uv = tl.load(w_rows + r[None, :], mask=vmask[:, None] & (r < RANK)[None, :],
                           other=0.0).to(tl.float32)  # [BLOCK_V, BLOCK_R]
        acc += tl.sum(w_uv * latent[None, :], 1)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + v, acc.to(out_ptr.dtype.element_ty), mask=vmask)


MERGE_UV_MAX_ROWS = 8  # beyond, each program's W_UV tile read (per row) costs more than merge + einsum


def mla_merge_uv(part_out: torch.Tensor, part_lse: torch.Tensor, w_uv: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """part_out [T, H, S, R], part_lse [T, H, S] fp32 (contiguous), w_uv [H, v, R] -> out [T, H, v].
    One program per (row, head, v tile): for decode-sized T (<= MERGE_UV_MAX_ROWS is where it pays)."""
    t, heads, splits, rank = part_out.shape
    v_dim = w_uv.shape[1]
    if part_lse.shape != (t, heads, splits) or w_uv.shape != (heads, v_dim, rank) or not w_uv.is_contiguous():
        raise DsquantError(f"mla_merge_uv: expected part_lse [{t}, {heads}, {splits}] and contiguous w_uv "
                           f"[{heads}, v, {rank}], got {tuple(part_lse.shape)}, {tuple(w_uv.shape)}")
    if out is None:
        out = torch.empty(t, heads, v_dim, dtype=w_uv.dtype, device=part_out.device)
    if t:
        block_s = max(2, triton.next_power_of_2(splits))
        chunk_s = min(block_s, 8)
        block_r = max(16, min(rank, 4096 // chunk_s))
        block_v = 32
        grid = (t, heads, triton.cdiv(v_dim, block_v))
        _mla_merge_uv_kernel[grid](part_out, part_lse, w_uv, out, out.stride(0), out.stride(1),
                                   heads, splits, v_dim, RANK=rank, BLOCK_S=block_s, CHUNK_S=chunk_s,
                                   BLOCK_R=block_r, BLOCK_V=block_v, num_warps=4,
                                   **pdl.launch(part_out.device))
    return out
