"""Paged decode attention for GQA / MHA (one new query token per sequence), split-KV.

Layouts
- query [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (kv_store.py writes them);
  Hq = G x Hkv, query head h reads kv head h // G.
- block_table [B, max_blocks] int32; seq_lens [B] int32 (tokens in the cache, the current one
  included; 0 gives zeros, for padded batch rows).
- out [B, Hq, D] in query's dtype. D need not be a power of two.
- FP8 cache (--kv-cache-dtype fp8, kv_fp8_layout.py): k_cache, v_cache float8_e4m3fn and
  k_scale, v_scale float32 [num_blocks, block_size, Hkv]. Keys and values are converted to the
  query's dtype in registers (exact: e4m3 fits in fp16 and bf16); the per-token scales multiply
  the score columns (k) and the probabilities (v), which equals attending to q * scale.

Program (b, kv head, split) holds the G query heads of one kv head as the rows of one tile (padded
to 16 for the tensor-core dot), so every key and value is read once for the whole group. It walks
its chunk of the context in tiles of BLOCK_N tokens, each token's page found through the block
table (any block_size divides BLOCK_N's positions), with an online softmax in base 2. With more
than one split each program writes a partial result and split_kv_merge merges them.

The number of splits is a heuristic on B x Hkv, the host-known max_seq_len and the SM count, so
the launch is CUDA-graph safe (no device-to-host reads).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsquant.errors import DsquantError
from dsquant.runtime.kernels.attention.fp8_words import words_asm_default, words_fit
from dsquant.runtime.kernels.attention.paged_decode_fp8 import paged_decode_fp8_words_kernel
from dsquant.runtime.kernels.attention.split_kv_merge import (choose_num_splits, merge_splits, num_sms, split_bounds,
                                                                  store_split_result)

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters; num_splits 0 means "choose by heuristic"."""
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int = 0
    fp8_f16: bool = False  # FP8 cache: both dots in fp16 (q rounded to fp16 once; e4m3 -> fp16 is one
    # instruction per pair, -> bf16 goes through fp32)
    fp8_words: bool = False  # FP8 cache: paged_decode_fp8.py's kernel (tiles read as int32 words, fp16 dots
    # with the query and value scales normalized by powers of two); needs D % 4 == 0 and 4-byte-aligned rows


# the launch over an FP8 cache when the caller gives none
FP8_CONFIG = DecodeConfig()


@triton.jit
def _paged_decode_gqa_kernel(
    q_ptr, stride_qb, stride_qh,  # query [B, Hq, D]
    k_ptr, v_ptr, stride_cblk, stride_ctok, stride_chead,  # caches [num_blocks, block_size, Hkv, D]
    ks_ptr, vs_ptr, stride_sblk, stride_stok,  # FP8: scales [num_blocks, block_size, Hkv] fp32
    block_table_ptr, stride_bt, seq_lens_ptr,  # [B, max_blocks] int32, [B] int32
    out_ptr, stride_ob, stride_oh,  # out [B, Hq, D] (not IS_SPLIT)
    part_out_ptr, part_lse_ptr,  # [B, Hq, S, D], [B, Hq, S] float32 (IS_SPLIT)
    scale_log2, num_splits, num_q_heads,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_SPLIT: tl.constexpr, KV_FP8: tl.constexpr,
    F16: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start, end = split_bounds(seq_len, split, num_splits, BLOCK_N, 0, 4)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g  # [BLOCK_G]
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if KV_FP8 and F16:
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_table_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        nmask = n < end
        blk = tl.load(table + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        row = blk * stride_cblk + (n % BLOCK_SIZE) * stride_ctok + kv_head * stride_chead  # [BLOCK_N]
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if KV_FP8:
            srow = blk * stride_sblk + (n % BLOCK_SIZE) * stride_stok + kv_head  # [BLOCK_N]
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
            s = s * (tl.load(ks_ptr + srow, mask=nmask, other=0.0) * scale_log2)[None, :]  # [BLOCK_G, BLOCK_N]
        else:
            s = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if KV_FP8:
            p = p * tl.load(vs_ptr + srow, mask=nmask, other=0.0)[None, :]
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    store_split_result(out, m_i, l_i, b, heads, gmask, d, dmask, end > start, split, num_q_heads, num_splits,
                       out_ptr + b * stride_ob, stride_oh, part_out_ptr, part_lse_ptr, HEAD_DIM, IS_SPLIT)


def check_fp8_scales(name: str, k_cache, v_cache, k_scale, v_scale) -> bool:
    """Whether the caches are FP8 (then with fp32 scales [num_blocks, block_size, Hkv] of equal strides)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 != (k_scale is not None) or fp8 != (v_scale is not None) or v_cache.dtype != k_cache.dtype:
        raise DsquantError(f"{name}: float8_e4m3fn caches need k_scale and v_scale (and only they do), got "
                           f"{k_cache.dtype}, {v_cache.dtype} caches and scales "
                           f"{'given' if k_scale is not None else 'missing'}")
    if fp8 and (k_scale.shape != k_cache.shape[:3] or k_scale.dtype != torch.float32
                or v_scale.shape != k_scale.shape or v_scale.stride() != k_scale.stride()):
        raise DsquantError(f"{name}: k_scale, v_scale must be fp32 {tuple(k_cache.shape[:3])} with equal strides, "
                           f"got {k_scale.dtype} {tuple(k_scale.shape)}, {tuple(v_scale.shape)}")
    return fp8


def _check(query, k_cache, v_cache, block_table, seq_lens) -> None:
    if query.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise DsquantError(f"paged decode: expected query [B, Hq, D] and caches [num_blocks, block_size, Hkv, D], "
                           f"got {tuple(query.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or query.stride(-1) != 1:
        raise DsquantError("paged decode: k_cache and v_cache need equal strides and a unit last stride, as does query")
    hq, hkv = query.shape[1], k_cache.shape[2]
    if hq % hkv or query.shape[2] != k_cache.shape[3]:
        raise DsquantError(f"paged decode: {hq} query heads of dim {query.shape[2]} do not fit {hkv} kv heads "
                           f"of dim {k_cache.shape[3]}")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_table.shape[0] != query.shape[0]:
        raise DsquantError(f"paged decode: block_table [B, max_blocks] and seq_lens [B] must be int32 with "
                           f"B={query.shape[0]}, got {block_table.dtype} {tuple(block_table.shape)}, {seq_lens.dtype}")


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           max_seq_len: int | None = None, config: DecodeConfig | None = None,
                           out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of query [B, Hq, D] over the paged caches -> out [B, Hq, D].

    max_seq_len (host int, an upper bound of seq_lens) sizes the splits; by default the block
    table's capacity, max_blocks x block_size. k_scale, v_scale: with FP8 caches (module docstring).
    config None: FP8_CONFIG over an FP8 cache, else DecodeConfig().
    """
    _check(query, k_cache, v_cache, block_table, seq_lens)
    fp8 = check_fp8_scales("paged decode", k_cache, v_cache, k_scale, v_scale)
    config = config or (FP8_CONFIG if fp8 else DecodeConfig())
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)  # unused unless fp8
    batch, hq, dim = query.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    if max_seq_len is None:
        max_seq_len = block_table.shape[1] * block_size
    if out is None:
        out = torch.empty_like(query)
    splits = config.num_splits or choose_num_splits(batch * hkv, max_seq_len, 4 * config.block_n, num_sms(query.device))
    block_d = max(16, triton.next_power_of_2(dim))
    if splits > 1:
        part_out = torch.empty(batch, hq, splits, dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(batch, hq, splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    kernel, variant = _paged_decode_gqa_kernel, dict(KV_FP8=fp8, F16=fp8 and config.fp8_f16)
    if fp8 and config.fp8_words and words_fit(k_cache, v_cache):
        kernel, variant = paged_decode_fp8_words_kernel, dict(ASM=words_asm_default())
    kernel[(batch, hkv, splits)](
        query, query.stride(0), query.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks, vs, ks.stride(0), ks.stride(1),
        block_table, block_table.stride(0), seq_lens,
        out, out.stride(0), out.stride(1),
        part_out, part_lse,
        scale * LOG2E, splits, hq,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=config.block_n, IS_SPLIT=splits > 1, **variant,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        merge_splits(part_out, part_lse, out)
    return out


def default_scale(head_dim: int) -> float:
    """1 / sqrt(head_dim), the usual softmax scale."""
    return 1.0 / math.sqrt(head_dim)
