"""MLA prefill in the unabsorbed form: per-head keys and values expanded from the latent cache, then
a causal flash-attention kernel over them (issue 23).

The absorbed form (mla_decode.py) costs 2 x H x (R + R + P) FLOP per (query, key) pair, against
2 x H x (nope + rope + v) here: with DeepSeek's R 512, nope 128, rope 64, v 128 that is 3.4x less
dot work, and one 8192-token chunk expands its keys once for all its queries. This is the
prefill path of TritonPagedAttention (decode steps stay absorbed).

Layouts
- q_nope [T, H, NOPE] (not absorbed), q_pe [T, H, ROPE] (rotated): the new tokens of all sequences
  packed, sequence b owning rows cu_seqlens_q[b] : cu_seqlens_q[b+1].
- kv_cache [num_blocks, block_size, R + P] (model dtype) or the FP8 uint8 token layout
  (kv_fp8_layout.py); block_table [B, max_blocks] int32; seq_lens [B] int32 (cached + new, the new
  tokens already stored).
- w_uk [H, NOPE, R], w_uv [H, V, R]: kv_b_proj's weight split per head (attention_triton.prepare).
- Expanded keys and values (expand_keys): k_nope [S, H, NOPE], v [S, H, V] and the shared rope key
  k_pe [S, ROPE], S = sum of seq_lens; sequence b's keys are rows cu_seqlens_k[b] : cu_seqlens_k[b+1].
- out [T, H, V] in q_nope's dtype. Query i of sequence b (position ctx_b + i, ctx_b = seq_len -
  q_len) attends to keys 0 .. ctx_b + i.

Kernel program (query tile, head, sequence) walks the key tiles of its sequence up to its tile's
last causal position (the tiles above the diagonal are skipped, the mask applied only where a tile
crosses it), scores = q_nope . k_nope + q_pe . k_pe in two dots, an online softmax in base 2.
NOPE, ROPE and V must be powers of two >= 16 (DeepSeek: 128, 64, 128); `supported` says.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels.attention.kv_fp8_layout import dequantize_mla_fp8

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class MLAPrefillConfig:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


def _pow2(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0


def supported(nope: int, rope: int, v: int) -> bool:
    """Whether the kernel takes these head dims (else the caller keeps the absorbed path)."""
    return _pow2(nope) and _pow2(rope) and _pow2(v)


@triton.jit
def _tile(acc, m_i, l_i, q_nope, q_pe, q_pos, n0, k_start, k_len, head, kn_ptr, stride_knt, stride_knh,
          kp_ptr, stride_kpt, v_ptr, stride_vt, stride_vh, scale_log2,
          NOPE: tl.constexpr, ROPE: tl.constexpr, V: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """One key tile of the online softmax; MASKED: the tile crosses the diagonal or the keys' end."""
    n = n0 + tl.arange(0, BLOCK_N)  # [BN] key positions
    nmask = n < k_len
    krow = (k_start + n).to(tl.int64)
    dn, dp, dv = tl.arange(0, NOPE), tl.arange(0, ROPE), tl.arange(0, V)
    k_nope = tl.load(kn_ptr + krow[:, None] * stride_knt + head * stride_knh + dn[None, :],
                     mask=nmask[:, None], other=0.0)  # [BN, NOPE]
    k_pe = tl.load(kp_ptr + krow[:, None] * stride_kpt + dp[None, :], mask=nmask[:, None], other=0.0)  # [BN, ROPE]
    s = tl.dot(q_nope, tl.trans(k_nope))
    s = tl.dot(q_pe, tl.trans(k_pe), s) * scale_log2  # [BM, BN]
    if MASKED:
        s = tl.where((n[None, :] <= q_pos[:, None]) & nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + krow[:, None] * stride_vt + head * stride_vh + dv[None, :],
                mask=nmask[:, None], other=0.0)  # [BN, V]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _mla_prefill_kernel(
    qn_ptr, stride_qnt, stride_qnh,  # q_nope [T, H, NOPE]
    qp_ptr, stride_qpt, stride_qph,  # q_pe [T, H, ROPE]
    kn_ptr, stride_knt, stride_knh,  # k_nope [S, H, NOPE]
    kp_ptr, stride_kpt,  # k_pe [S, ROPE]
    v_ptr, stride_vt, stride_vh,  # v [S, H, V]
    out_ptr, stride_ot, stride_oh,  # out [T, H, V]
    cu_q_ptr, cu_k_ptr,  # [B + 1] int32 each
    scale_log2,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_k_ptr + b)
    k_len = tl.load(cu_k_ptr + b + 1) - k_start
    ctx = k_len - q_len

    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] query rows of this sequence
    mmask = m < q_len
    dn, dp, dv = tl.arange(0, NOPE), tl.arange(0, ROPE), tl.arange(0, V)
    rows = (q_start + m).to(tl.int64)
    q_nope = tl.load(qn_ptr + rows[:, None] * stride_qnt + head * stride_qnh + dn[None, :],
                     mask=mmask[:, None], other=0.0)  # [BM, NOPE]
    q_pe = tl.load(qp_ptr + rows[:, None] * stride_qpt + head * stride_qph + dp[None, :],
                   mask=mmask[:, None], other=0.0)  # [BM, ROPE]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V], tl.float32)
    q_pos = ctx + m  # [BM] positions of the queries
    hi = tl.minimum(k_len, ctx + (m_block + 1) * BLOCK_M)  # keys past the tile's last query are skipped
    full_end = ((ctx + m_block * BLOCK_M) // BLOCK_N) * BLOCK_N  # tiles before it are below the diagonal
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q_nope, q_pe, q_pos, n0, k_start, k_len, head, kn_ptr, stride_knt,
                              stride_knh, kp_ptr, stride_kpt, v_ptr, stride_vt, stride_vh, scale_log2,
                              NOPE, ROPE, V, BLOCK_N, False)
    for n0 in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q_nope, q_pe, q_pos, n0, k_start, k_len, head, kn_ptr, stride_knt,
                              stride_knh, kp_ptr, stride_kpt, v_ptr, stride_vt, stride_vh, scale_log2,
                              NOPE, ROPE, V, BLOCK_N, True)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


def mla_prefill_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                          v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          max_q_len: int, scale: float, config: MLAPrefillConfig = MLAPrefillConfig(),
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal varlen attention of q_nope [T, H, NOPE], q_pe [T, H, ROPE] over k_nope [S, H, NOPE],
    k_pe [S, ROPE], v [S, H, V] -> out [T, H, V] (module docstring). max_q_len: host int."""
    t, heads, nope = q_nope.shape
    rope, vdim = q_pe.shape[-1], v.shape[-1]
    if not supported(nope, rope, vdim) or k_nope.shape[1:] != (heads, nope) or k_pe.shape[-1] != rope \
            or v.shape[1] != heads or min(x.stride(-1) for x in (q_nope, q_pe, k_nope, k_pe, v)) != 1:
        raise ValueError(f"mla prefill: q_nope {tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, k_nope "
                         f"{tuple(k_nope.shape)}, k_pe {tuple(k_pe.shape)}, v {tuple(v.shape)}: head dims must be "
                         f"powers of two >= 16, shapes consistent, unit last strides")
    if out is None:
        out = torch.empty(t, heads, vdim, dtype=q_nope.dtype, device=q_nope.device)
    batch = cu_seqlens_q.shape[0] - 1
    grid = (triton.cdiv(max(max_q_len, 1), config.block_m), heads, batch)
    _mla_prefill_kernel[grid](
        q_nope, q_nope.stride(0), q_nope.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1),
        k_nope, k_nope.stride(0), k_nope.stride(1), k_pe, k_pe.stride(0), v, v.stride(0), v.stride(1),
        out, out.stride(0), out.stride(1), cu_seqlens_q, cu_seqlens_k, scale * LOG2E,
        NOPE=nope, ROPE=rope, V=vdim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def expand_keys(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, total_keys: int,
                w_uk: torch.Tensor, w_uv: torch.Tensor, rope: int, rope_dtype: torch.dtype | None = None):
    """Every cached key of every sequence, expanded per head: (k_nope [S, H, NOPE], k_pe [S, ROPE],
    v [S, H, V], cu_seqlens_k [B + 1] int32), S = total_keys = sum(seq_lens) (a host int: no sync).
    kv_cache uint8 is the FP8 layout (rope_dtype: its rope key's dtype), dequantized here."""
    heads, nope, rank = w_uk.shape
    dev, bs = kv_cache.device, kv_cache.shape[1]
    lens = seq_lens.to(torch.long)
    cu = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(lens, 0)
    seq_of_key = torch.repeat_interleave(torch.arange(lens.shape[0], device=dev), lens, output_size=total_keys)
    pos = torch.arange(total_keys, device=dev) - cu[:-1].long()[seq_of_key]  # [S] position in its sequence
    slots = block_table[seq_of_key, pos // bs].long() * bs + pos % bs  # [S]
    rows = kv_cache.view(-1, kv_cache.shape[-1])[slots]  # [S, width]
    if kv_cache.dtype == torch.uint8:
        rows = dequantize_mla_fp8(rows, rank, rope, rope_dtype).to(w_uk.dtype)
    latent, k_pe = rows[:, :rank], rows[:, rank:].contiguous()  # [S, R], [S, ROPE]
    k_nope = (latent @ w_uk.reshape(heads * nope, rank).t()).view(total_keys, heads, nope)
    v = (latent @ w_uv.reshape(-1, rank).t()).view(total_keys, heads, -1)
    return k_nope, k_pe, v, cu
