"""Paged prefill attention for GQA / MHA: causal, variable-length batch, context read from the cache.

Serves plain prefill, chunked prefill and prefix caching alike: the caller first stores the new
tokens' keys and values (kv_store.store_kv), then every key, cached prefix and new tokens, is read
from the paged cache.

Layouts
- q [Tq, Hq, D]: the new tokens of all sequences packed; sequence b owns rows
  cu_seqlens_q[b] : cu_seqlens_q[b+1] (cu_seqlens_q [B+1] int32, starting at 0).
- k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_table [B, max_blocks] int32.
- seq_lens [B] int32: tokens of sequence b in the cache, new ones included; its context (prefix)
  is ctx_b = seq_lens[b] - q_len_b, and new token i (position ctx_b + i) attends to keys
  0 .. ctx_b + i.
- out [Tq, Hq, D] in q's dtype. Hq = G x Hkv; query head h reads kv head h // G.
- FP8 cache: k_cache, v_cache float8_e4m3fn with k_scale, v_scale fp32 [num_blocks, block_size, Hkv],
  dequantized in registers as in paged_decode.py (scales on the score columns and the probabilities).

MLA prefill: mla_prefill.py (unabsorbed, per-head keys expanded from the latent cache) for long
steps, mla_decode.py in absorbed form (one row per new token) for short ones.

Program (query head, sequence, query tile) runs a flash-attention loop over key tiles of BLOCK_N
tokens up to its tile's last causal position, pages found through the block table per key: the
tiles wholly below the diagonal without a mask, the ones crossing it masked, none above it. The
query tiles are launched last-first (the longest rows first), so the short ones fill the last wave.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsquant.errors import DsquantError
from dsquant.runtime.kernels.attention.paged_decode import check_fp8_scales

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters; the default is for head_dim <= 128 (H200, scripts/prefill_sweep.py, 2026-12-02:
    the fastest of 8 at B=4 L=4096 for block sizes 16 and 64, within 4% of the best at B=1 L=16384)."""
    block_m: int = 128
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3


WIDE_HEAD_CONFIG = PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)  # head_dim > 128


@triton.jit
def _tile(acc, m_i, l_i, q, pos, n0, hi, table, kv_head, k_ptr, v_ptr, stride_cblk, stride_ctok, stride_chead,
          ks_ptr, vs_ptr, stride_sblk, stride_stok, scale_log2, d, dmask,
          BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, EVEN_D: tl.constexpr,
          MASKED: tl.constexpr):
    """One key tile [n0, n0 + BLOCK_N) of the online softmax; MASKED: it crosses the diagonal or hi."""
    n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    nmask = n < hi
    blk = tl.load(table + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    off = blk * stride_cblk + (n % BLOCK_SIZE) * stride_ctok + kv_head * stride_chead  # [BLOCK_N]
    kv_mask = nmask[:, None] & dmask[None, :]
    if MASKED or not EVEN_D:
        k = tl.load(k_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    else:  # every key of the tile is < hi
        k = tl.load(k_ptr + off[:, None] + d[None, :])
    if KV_FP8:
        soff = blk * stride_sblk + (n % BLOCK_SIZE) * stride_stok + kv_head  # [BLOCK_N]
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = s * (tl.load(ks_ptr + soff, mask=nmask, other=0.0) * scale_log2)[None, :]  # [BLOCK_M, BLOCK_N]
    else:
        s = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_M, BLOCK_N]
    if MASKED:
        s = tl.where((n[None, :] <= pos[:, None]) & nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED or not EVEN_D:
        v = tl.load(v_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_ptr + off[:, None] + d[None, :])
    if KV_FP8:
        p = p * tl.load(vs_ptr + soff, mask=nmask, other=0.0)[None, :]
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _paged_prefill_kernel(
    q_ptr, stride_qt, stride_qh,  # q [Tq, Hq, D]
    k_ptr, v_ptr, stride_cblk, stride_ctok, stride_chead,  # caches [num_blocks, block_size, Hkv, D]
    ks_ptr, vs_ptr, stride_sblk, stride_stok,  # FP8: scales [num_blocks, block_size, Hkv] fp32
    block_table_ptr, stride_bt, seq_lens_ptr, cu_seqlens_q_ptr,  # [B, max_blocks], [B], [B + 1] int32
    out_ptr, stride_ot, stride_oh,  # out [Tq, Hq, D]
    scale_log2, num_m_blocks,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
):
    head = tl.program_id(0)
    b = tl.program_id(1)
    m_block = num_m_blocks - 1 - tl.program_id(2)  # the longest causal rows first: the last wave is short
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    if m_block * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + b)
        ctx = seq_len - q_len
        m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] index among the new tokens
        mmask = m < q_len
        pos = ctx + m  # absolute positions
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        rows = (q_start + m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=mmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        kv_head = head // GROUP
        table = block_table_ptr + b.to(tl.int64) * stride_bt

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = tl.minimum(seq_len, ctx + (m_block + 1) * BLOCK_M)  # keys past the tile's last row are skipped
        full_end = ((ctx + m_block * BLOCK_M) // BLOCK_N) * BLOCK_N  # tiles before it: below the diagonal
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, pos, n0, hi, table, kv_head, k_ptr, v_ptr, stride_cblk,
                                  stride_ctok, stride_chead, ks_ptr, vs_ptr, stride_sblk, stride_stok, scale_log2,
                                  d, dmask, BLOCK_SIZE, BLOCK_N, KV_FP8, HEAD_DIM == BLOCK_D, False)
        # key 0 is visible to every row, so each row's running max is finite after the first tile
        for n0 in range(full_end, hi, BLOCK_N):
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, pos, n0, hi, table, kv_head, k_ptr, v_ptr, stride_cblk,
                                  stride_ctok, stride_chead, ks_ptr, vs_ptr, stride_sblk, stride_stok, scale_log2,
                                  d, dmask, BLOCK_SIZE, BLOCK_N, KV_FP8, HEAD_DIM == BLOCK_D, True)
        out = acc / l_i[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def _check(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise DsquantError(f"paged prefill: expected q [Tq, Hq, D] and equal caches [num_blocks, block_size, Hkv, D], "
                           f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3] or q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise DsquantError(f"paged prefill: {q.shape[1]} query heads of dim {q.shape[2]} (unit last stride) do not "
                           f"fit {k_cache.shape[2]} kv heads of dim {k_cache.shape[3]}")
    batch = seq_lens.shape[0]
    if (cu_seqlens_q.dtype, seq_lens.dtype, block_table.dtype) != (torch.int32,) * 3 or \
            cu_seqlens_q.shape != (batch + 1,) or block_table.shape[0] != batch:
        raise DsquantError(f"paged prefill: cu_seqlens_q [B+1], seq_lens [B], block_table [B, max_blocks] must be "
                           f"int32, got {tuple(cu_seqlens_q.shape)}, {tuple(seq_lens.shape)}, {tuple(block_table.shape)}")


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            scale: float, max_q_len: int | None = None, config: PrefillConfig | None = None,
                            out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                            v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Causal varlen attention of q [Tq, Hq, D] over the paged caches -> out [Tq, Hq, D].

    max_q_len (host int) sizes the grid; when omitted it is read from cu_seqlens_q (a device sync).
    config: None picks PrefillConfig() for head_dim <= 128, else WIDE_HEAD_CONFIG.
    k_scale, v_scale: with FP8 caches (module docstring).
    k_new, v_new [Tq, Hkv, D]: the new tokens' keys and values as stored; where prefill_tma.supported
    takes them (a Hopper GPU, a model-dtype cache) and no config is given, the new keys are read from
    them through TMA and only the cached prefix from the pages (prefill_tma.py).
    """
    _check(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q)
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if seq_lens.numel() else 0
    if k_new is not None and config is None and k_scale is None:
        from dsquant.runtime.kernels.attention import prefill_tma

        if prefill_tma.supported(q, k_new, v_new, k_cache):
            return prefill_tma.prefill_tma_attention(q, k_new, v_new, k_cache, v_cache, block_table, seq_lens,
                                                     cu_seqlens_q, scale, max_q_len, out=out)
    fp8 = check_fp8_scales("paged prefill", k_cache, v_cache, k_scale, v_scale)
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)  # unused unless fp8
    _, hq, dim = q.shape
    if config is None:
        config = PrefillConfig() if dim <= 128 else WIDE_HEAD_CONFIG
    if out is None:
        out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    if batch == 0 or max_q_len == 0:
        return out
    num_m = triton.cdiv(max_q_len, config.block_m)
    grid = (hq, batch, num_m)
    _paged_prefill_kernel[grid](
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks, vs, ks.stride(0), ks.stride(1),
        block_table, block_table.stride(0), seq_lens, cu_seqlens_q,
        out, out.stride(0), out.stride(1),
        scale * LOG2E, num_m,
        GROUP=hq // k_cache.shape[2], HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=config.block_m, BLOCK_N=config.block_n, KV_FP8=fp8,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
