"""GQA / MHA prefill whose new tokens' keys and values come from the projections, through TMA (issue 23).

paged_prefill.py reads every key from the paged cache, one address per key. A prefill step has
its new tokens' keys and values at hand, contiguous per token, before (and beside) their store
into the cache; this kernel reads those with tensor-memory-accelerator boxes and only the cached
prefix (chunked prefill, prefix caching) through the block table.

Layouts
- q [Tq, Hq, D], out [Tq, Hq, D]: the new tokens of all sequences packed; sequence b owns rows
  cu_seqlens_q[b] : cu_seqlens_q[b+1] (cu_seqlens_q [B+1] int32, starting at 0).
- k_new, v_new [Tq, Hkv, D] (row stride free, heads contiguous, D contiguous): the same rows'
  keys and values, read through 2-D descriptors over [Tq, Hkv x D] in [BLOCK_N, D] boxes.
- k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_table [B, max_blocks] int32;
  seq_lens [B] int32 = ctx_b + q_len_b: the context ctx_b (the cached prefix) is read from the
  pages, the new tokens from k_new / v_new (the cache may hold them too; they are not read there).
- Query i of sequence b (position ctx_b + i) attends to the ctx_b prefix keys and new keys 0 .. i.
  Hq = G x Hkv; query head h reads kv head h // G. D a power of two, 16..128.

Program (query head, sequence, query tile of BLOCK_M new tokens, longest tiles first) runs a flash-
attention loop: the prefix tiles from the pages (mask only on the last, partial one), then the new
keys below the tile's diagonal without a mask, then the BLOCK_M keys on it, masked. A box of new
keys may run into the next sequence's rows (or past Tq, which TMA fills with zeros); those keys lie
above every valid row's diagonal, so the mask drops them. q is loaded and out stored with masked
pointer accesses, so no row of another sequence is written.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class TMAPrefillConfig:
    """Launch parameters; block_m a multiple of block_n; pipeline: the next key tile's q k^T written
    before the current tile's softmax (won at 8 warps, lost at 4).
    The default tile was the fastest of 11 on an H200 and of 16 on an H100 at D 128 (scripts/prefill_tma_probe.py,
    2026-12-07): one warp group of 128 rows, two programs a multiprocessor. Triton 3.6's automatic warp
    specialization (tl.range(warp_specialize=True)) changed nothing at 8 warps and did not compile at 4."""
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    pipeline: bool = False


@triton.jit
def _softmax_step_fma(acc, m_i, l_i, s, v, scale_log2):
    """Online-softmax update with the unscaled scores s [BLOCK_M, BLOCK_N] and values v [BLOCK_N, D]; the
    scale (log2 e included) is folded into the exponent's subtraction, one FMA an element. (FlashAttention-4's
    lazy rescale, which skips most tiles' [BLOCK_M, D] rescale of acc, ran 0.91-0.92x as fast on an H100 at the
    default tile: 2026-12-07, BENCHMARKS.md.)"""
    m_tile = tl.max(s, 1) * scale_log2
    m_new = tl.maximum(m_i, m_tile)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _prefill_tma_kernel(
    q_ptr, stride_qt, stride_qh,  # q [Tq, Hq, D]
    k_desc, v_desc,  # descriptors over k_new / v_new as [Tq, Hkv * D], box [BLOCK_N, D]
    k_ptr, v_ptr, stride_cblk, stride_ctok, stride_chead,  # caches [num_blocks, block_size, Hkv, D]
    block_table_ptr, stride_bt, seq_lens_ptr, cu_seqlens_q_ptr,  # [B, max_blocks], [B], [B + 1] int32
    out_ptr, stride_ot, stride_oh,  # out [Tq, Hq, D]
    scale_log2, num_m_blocks,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PIPELINE: tl.constexpr,
):
    head = tl.program_id(0)
    b = tl.program_id(1)
    m_block = num_m_blocks - 1 - tl.program_id(2)  # the longest causal rows first
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 < q_len:
        ctx = tl.load(seq_lens_ptr + b) - q_len
        m = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] index among the new tokens
        mmask = m < q_len
        d = tl.arange(0, D)
        rows = (q_start + m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=mmask[:, None], other=0.0)  # [BLOCK_M, D]
        kv_head = head // GROUP
        col = kv_head * D

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # the cached prefix, from the pages: every new token sees all of it
        table = block_table_ptr + b.to(tl.int64) * stride_bt
        for n0 in range(0, ctx, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
            nmask = n < ctx
            blk = tl.load(table + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
            off = blk * stride_cblk + (n % BLOCK_SIZE) * stride_ctok + kv_head * stride_chead  # [BLOCK_N]
            k = tl.load(k_ptr + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)  # [BLOCK_N, D]
            s = tl.where(nmask[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
            v = tl.load(v_ptr + off[:, None] + d[None, :], mask=nmask[:, None], other=0.0)
            acc, m_i, l_i = _softmax_step_fma(acc, m_i, l_i, s, v, scale_log2)
        # new keys wholly below the tile's diagonal: no mask
        if PIPELINE:  # the next tile's q k^T issued before this tile's softmax (FlashAttention-3's overlap)
            if m0 > 0:
                k = k_desc.load([q_start, col])
                s = tl.dot(q, k.T)
                for j0 in range(BLOCK_N, m0, BLOCK_N):
                    k = k_desc.load([q_start + j0, col])
                    s_next = tl.dot(q, k.T)
                    v = v_desc.load([q_start + j0 - BLOCK_N, col])
                    acc, m_i, l_i = _softmax_step_fma(acc, m_i, l_i, s, v, scale_log2)
                    s = s_next
                v = v_desc.load([q_start + m0 - BLOCK_N, col])
                acc, m_i, l_i = _softmax_step_fma(acc, m_i, l_i, s, v, scale_log2)
        else:
            for j0 in range(0, m0, BLOCK_N):
                k = k_desc.load([q_start + j0, col])  # [BLOCK_N, D]
                s = tl.dot(q, k.T)
                v = v_desc.load([q_start + j0, col])
                acc, m_i, l_i = _softmax_step_fma(acc, m_i, l_i, s, v, scale_log2)
        # the diagonal: new keys m0 .. m0 + BLOCK_M, key j visible to row i when j <= i
        for j0 in range(m0, m0 + BLOCK_M, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            k = k_desc.load([q_start + j0, col])
            s = tl.where(j[None, :] <= m[:, None], tl.dot(q, k.T), float("-inf"))
            v = v_desc.load([q_start + j0, col])
            acc, m_i, l_i = _softmax_step_fma(acc, m_i, l_i, s, v, scale_log2)
        out = acc / l_i[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


def supported(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the TMA kernel takes these tensors: a Hopper-or-later GPU, 16-bit model-dtype caches,
    D a power of two in 16..128 (the default config's [128, D] fp32 accumulator in one warp group's
    registers; wider heads keep the paged kernel), heads and D contiguous, 16-byte-aligned rows (TMA's rules)."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9):
        return False
    d = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype or d & (d - 1) or not 16 <= d <= 128:
        return False
    if k_new.shape != v_new.shape or k_new.dim() != 3 or k_new.shape[0] != q.shape[0] or k_new.shape[2] != d or \
            q.shape[1] % k_new.shape[1]:
        return False
    for t in (k_new, v_new):
        if t.dtype != q.dtype or t.stride(2) != 1 or t.stride(1) != d or \
                (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


def _descriptor(t: torch.Tensor, block_n: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, heads, d = t.shape
    return TensorDescriptor(t, [rows, heads * d], [t.stride(0), 1], [block_n, d])


def prefill_tma_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, scale: float, max_q_len: int,
                          config: TMAPrefillConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal varlen attention of q [Tq, Hq, D] over the cached prefix and k_new / v_new [Tq, Hkv, D]
    -> out [Tq, Hq, D] (module docstring). Callers check `supported` first."""
    config = config or TMAPrefillConfig()
    if config.block_m % config.block_n:
        raise ValueError(f"prefill_tma: block_m {config.block_m} is not a multiple of block_n {config.block_n}")
    _, hq, dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    if batch == 0 or max_q_len == 0:
        return out
    num_m = triton.cdiv(max_q_len, config.block_m)
    _prefill_tma_kernel[(hq, batch, num_m)](
        q, q.stride(0), q.stride(1),
        _descriptor(k_new, config.block_n), _descriptor(v_new, config.block_n),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table, block_table.stride(0), seq_lens, cu_seqlens_q,
        out, out.stride(0), out.stride(1),
        scale * LOG2E, num_m,
        GROUP=hq // k_new.shape[1], D=dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, PIPELINE=config.pipeline,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
