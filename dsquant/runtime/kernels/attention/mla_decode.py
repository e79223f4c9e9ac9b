"""Absorbed MLA decode attention over a paged latent cache (DeepSeek V2/V3), split-KV.

Absorbed form: with c_t the latent of token t ([R], R = kv_lora_rank) and k_pe_t its rope key
([P], P = qk_rope_head_dim), head h's key is [W_UK_h c_t ; k_pe_t] and its value W_UV_h c_t. The
caller folds W_UK into the query (q_nope_absorbed_h = W_UK_h^T q_nope_h) so that
    score(h, t) = q_nope_absorbed_h . c_t + q_pe_h . k_pe_t,   out_h = sum_t softmax_t * c_t,
and brings out_h [R] back through W_UV_h. One read of the latent cache serves every head.

Layouts
- q_nope [B, H, R] (absorbed), q_pe [B, H, P]; kv_cache [num_blocks, block_size, R + P] (latent then
  rope key, written by kv_store.store_latent); R and P powers of two (DeepSeek: 512 and 64).
- block_table [B, max_blocks] int32, seq_lens [B] int32 (0 gives zeros).
- out [B, H, R] in q_nope's dtype: the attention output in latent space.
- FP8 cache (--kv-cache-dtype fp8): kv_cache is uint8 [num_blocks, block_size, R + 4R/128 + 2P],
  FlashMLA's token layout (kv_fp8_layout.py): e4m3 latent, one fp32 scale per 128 latent values,
  rope key in bf16 (fp16 for an fp16 model). Each latent tile is dequantized in registers to
  q_nope's dtype (q * scale, rounded once) before both dots; MLADecodeConfig(fold_fp8_scales=True)
  runs mla_decode_fp8.py's kernel instead (R <= 512: the per-(token, 128-group) scales folded into
  the dots), measured slower on the H200 so far.
- scale: the softmax scale, 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) times YaRN's mscale^2
  when the config has rope_scaling (the caller computes it; it enters only here).

A short prefill step (chunked or with a cached prefix) runs through this same kernel in absorbed
form, one row per new token (long ones go unabsorbed: mla_prefill.py): `prefill_rows` turns
(cu_seqlens_q, seq_lens, block_table) into per-token block tables and causal lengths (token i of a sequence sees positions 0 .. ctx + i). Each row re-reads
its prefix (from L2 when rows of a sequence run together): exact, but not a tiled prefill kernel.

Program (row b, head block, split) holds BLOCK_H heads as the rows of its tensor-core dots; each
latent tile [BLOCK_N, R] is loaded once and used for both QK^T and PV.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsquant.errors import DsquantError
from dsquant.runtime.kernels import pdl
from dsquant.runtime.kernels.attention.kv_fp8_layout import MLA_GROUP, fp8_rope_dtype, mla_fp8_token_bytes, mla_fp8_views
from dsquant.runtime.kernels.attention.mla_decode_fp8 import MAX_GROUPS, mla_decode_fp8_kernel
from dsquant.runtime.kernels.attention.fp8_words import words_asm_default, words_fit
from dsquant.runtime.kernels.attention.mla_decode_fp8_prefetch import mla_decode_fp8_prefetch_kernel
from dsquant.runtime.kernels.attention.mla_decode_fp8_words import mla_decode_fp8_words_kernel
from dsquant.runtime.kernels.attention.mla_decode_plan import LONG_SPLIT_TOKENS, MLADecodeConfig, default_config, launch_plan
from dsquant.runtime.kernels.attention.split_kv_merge import merge_splits, split_bounds

LOG2E = 1.4426950408889634


@triton.jit
def _mla_decode_kernel(
    qn_ptr, stride_qnb, stride_qnh,  # q_nope [B, H, R]
    qp_ptr, stride_qpb, stride_qph,  # q_pe [B, H, P]
    lat_ptr, stride_lblk, stride_ltok,  # latent [num_blocks, block_size, R] (a view of kv_cache)
    pe_ptr, stride_pblk, stride_ptok,  # rope key [num_blocks, block_size, P] (a view of kv_cache)
    sc_ptr, stride_sblk, stride_stok,  # FP8: scales [num_blocks, block_size, R / GROUP] fp32
    block_table_ptr, stride_bt, seq_lens_ptr,  # [B, max_blocks] int32, [B] int32
    out_ptr, stride_ob, stride_oh,  # out [B, H, R] (not IS_SPLIT)
    part_out_ptr, part_lse_ptr,  # [B, H, S, R], [B, H, S] float32 (IS_SPLIT)
    scale_log2, num_splits, num_heads,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_SPLIT: tl.constexpr, LONG_MIN: tl.constexpr,
    KV_FP8: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr, F16: tl.constexpr, MIN_TILES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start, end = split_bounds(seq_len, split, num_splits, BLOCK_N, LONG_MIN, MIN_TILES)

    r = tl.arange(0, RANK)
    p = tl.arange(0, ROPE)
    hmask = heads < num_heads
    qmask = hmask[:, None] & (end > start)  # an empty split reads nothing
    q_nope = tl.load(qn_ptr + b * stride_qnb + heads[:, None] * stride_qnh + r[None, :],
                     mask=qmask, other=0.0)  # [BLOCK_H, R]
    q_pe = tl.load(qp_ptr + b * stride_qpb + heads[:, None] * stride_qph + p[None, :],
                   mask=qmask, other=0.0)  # [BLOCK_H, P]
    if KV_FP8 and F16:
        q_nope = q_nope.to(tl.float16)
        q_pe = q_pe.to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK], tl.float32)
    table = block_table_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        blk = tl.load(table + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        tok = n % BLOCK_SIZE
        row = blk * stride_lblk + tok * stride_ltok  # [BLOCK_N]
        latent = tl.load(lat_ptr + row[:, None] + r[None, :], mask=nmask[:, None], other=0.0)  # [BLOCK_N, R]
        pe_row = blk * stride_pblk + tok * stride_ptok
        k_pe = tl.load(pe_ptr + pe_row[:, None] + p[None, :], mask=nmask[:, None], other=0.0)  # [BLOCK_N, P]
        if KV_FP8:
            s_row = blk * stride_sblk + tok * stride_stok
            if GROUPS == 1:
                sc = tl.load(sc_ptr + s_row, mask=nmask, other=0.0)[:, None]  # [BLOCK_N, 1]
            else:
                sc = tl.load(sc_ptr + s_row[:, None] + tl.arange(0, GROUPS)[None, :], mask=nmask[:, None],
                             other=0.0)  # [BLOCK_N, GROUPS]
                sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BLOCK_N, GROUPS, GROUP]), [BLOCK_N, RANK])
            if F16:  # e4m3 -> fp16 and the scale multiply, each one instruction per pair
                latent = latent.to(tl.float16) * sc.to(tl.float16)  # [BLOCK_N, R]
            else:
                latent = (latent.to(tl.float32) * sc).to(q_nope.dtype)  # [BLOCK_N, R]
            k_pe = k_pe.to(q_pe.dtype)
        s = tl.dot(q_nope, tl.trans(latent))
        s = tl.dot(q_pe, tl.trans(k_pe), s) * scale_log2  # [BLOCK_H, BLOCK_N]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(latent.dtype), latent)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if not IS_SPLIT:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        row_id = (b * num_heads + heads) * num_splits + split  # [BLOCK_H]
        tl.store(part_out_ptr + row_id[:, None] * RANK + r[None, :], out, mask=hmask[:, None] & (end > start))
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + row_id, lse, mask=hmask)


def _is_pow2(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0


def _check(q_nope, q_pe, kv_cache, block_table, seq_lens) -> None:
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2] or kv_cache.dim() != 3:
        raise DsquantError(f"mla decode: expected q_nope [B, H, R], q_pe [B, H, P], kv_cache [num_blocks, block_size, "
                           f"R + P], got {tuple(q_nope.shape)}, {tuple(q_pe.shape)}, {tuple(kv_cache.shape)}")
    rank, rope = q_nope.shape[2], q_pe.shape[2]
    if not (_is_pow2(rank) and _is_pow2(rope)):
        raise DsquantError(f"mla decode: kv_lora_rank {rank} and rope dim {rope} must be powers of two >= 16")
    if kv_cache.dtype == torch.uint8:
        if rank % MLA_GROUP or kv_cache.shape[2] != mla_fp8_token_bytes(rank, rope):
            raise DsquantError(f"mla decode: a uint8 (FP8) kv_cache holds {rank} + 4 x {rank}/{MLA_GROUP} + 2 x {rope} "
                               f"bytes per token (kv_lora_rank a multiple of {MLA_GROUP}), got {kv_cache.shape[2]}")
    elif kv_cache.shape[2] != rank + rope:
        raise DsquantError(f"mla decode: kv_cache last dim {kv_cache.shape[2]} must be kv_lora_rank {rank} + rope "
                           f"dim {rope}")
    if kv_cache.stride(-1) != 1 or q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise DsquantError("mla decode: q_nope, q_pe and kv_cache need a unit last stride")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_table.shape[0] != q_nope.shape[0]:
        raise DsquantError(f"mla decode: block_table [B, max_blocks] and seq_lens [B] must be int32 with "
                           f"B={q_nope.shape[0]}, got {block_table.dtype} {tuple(block_table.shape)}, {seq_lens.dtype}")


def _launch(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, config, plan, out, part_out, part_lse,
            is_split: bool):
    block_h, num_warps, head_blocks, splits = plan
    batch, heads, rank = q_nope.shape
    fp8 = kv_cache.dtype == torch.uint8
    if fp8:
        latent, scales, pe = mla_fp8_views(kv_cache, rank, q_pe.shape[2], fp8_rope_dtype(q_pe.dtype))
    else:
        latent, scales, pe = kv_cache[..., :rank], kv_cache, kv_cache[..., rank:]  # scales unused
    folded = fp8 and config.fold_fp8_scales and scales.shape[-1] <= MAX_GROUPS  # the scales folded into the dots (mla_decode_fp8.py)
    kernel = mla_decode_fp8_kernel if folded else _mla_decode_kernel
    if fp8 and not folded and config.fp8_prefetch:
        kernel = mla_decode_fp8_prefetch_kernel
    fp8_args = {"F16_DOTS": config.fp8_f16_dots} if folded else {"KV_FP8": fp8, "F16": fp8 and config.fp8_f16_dots}
    if fp8 and config.fp8_words and scales.shape[-1] <= MAX_GROUPS and words_fit(latent):
        kernel = mla_decode_fp8_words_kernel
        fp8_args = {"MIN_TILES": config.min_split_tiles, "ASM": words_asm_default(), "LAZY": config.lazy_rescale}
    if kernel is _mla_decode_kernel:
        fp8_args["MIN_TILES"] = config.min_split_tiles
        fp8_args.update(pdl.launch(q_nope.device))  # the FP8-cache kernels are launched without PDL
    kernel[(batch, head_blocks, splits)](
        q_nope, q_nope.stride(0), q_nope.stride(1),
        q_pe, q_pe.stride(0), q_pe.stride(1),
        latent, latent.stride(0), latent.stride(1),
        pe, pe.stride(0), pe.stride(1),
        scales, scales.stride(0), scales.stride(1),
        block_table, block_table.stride(0), seq_lens,
        out, out.stride(0), out.stride(1),
        part_out, part_lse,
        scale * LOG2E, splits, heads,
        RANK=rank, ROPE=q_pe.shape[2], BLOCK_H=block_h, BLOCK_SIZE=kv_cache.shape[1], BLOCK_N=config.block_n,
        IS_SPLIT=is_split, LONG_MIN=LONG_SPLIT_TOKENS, GROUPS=max(1, scales.shape[-1]) if fp8 else 1,
        GROUP=MLA_GROUP,
        num_warps=num_warps, num_stages=config.num_stages, **fp8_args,
        **({"maxnreg": config.max_regs} if config.max_regs else {}),
    )


def mla_decode_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         max_seq_len: int | None = None, config: MLADecodeConfig | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA attention -> out [B, H, R] in latent space (see the module docstring).

    max_seq_len (host int, an upper bound of seq_lens, e.g. max_model_len under a CUDA graph) only
    sizes the number of splits; each sequence spreads its own length over them."""
    _check(q_nope, q_pe, kv_cache, block_table, seq_lens)
    config = config or default_config(kv_cache, q_nope.shape[1], q_nope.shape[0])
    if out is None:
        out = torch.empty_like(q_nope)
    plan = launch_plan(q_nope, kv_cache, max_seq_len, config, block_table)
    if plan[3] == 1:
        _launch(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, config, plan, out, out, out, False)
        return out
    part_out, part_lse = _partials(q_nope, plan[3])
    _launch(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, config, plan, out, part_out, part_lse, True)
    merge_splits(part_out, part_lse, out)
    return out


def _partials(q_nope: torch.Tensor, splits: int):
    batch, heads, rank = q_nope.shape
    return (torch.empty(batch, heads, splits, rank, dtype=torch.float32, device=q_nope.device),
            torch.empty(batch, heads, splits, dtype=torch.float32, device=q_nope.device))


def mla_decode_split(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     max_seq_len: int | None = None, config: MLADecodeConfig | None = None):
    """The split-KV partial results, unmerged: (part_out [B, H, S, R], part_lse [B, H, S]) float32,
    or None when the plan has a single split (then call mla_decode_attention). For a caller that
    merges with its own epilogue (mla_absorb.mla_merge_uv folds W_UV into the merge)."""
    _check(q_nope, q_pe, kv_cache, block_table, seq_lens)
    config = config or default_config(kv_cache, q_nope.shape[1], q_nope.shape[0])
    plan = launch_plan(q_nope, kv_cache, max_seq_len, config, block_table)
    if plan[3] == 1:
        return None
    part_out, part_lse = _partials(q_nope, plan[3])
    _launch(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, config, plan, part_out, part_out, part_lse,
            True)
    return part_out, part_lse


def prefill_rows(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rows for absorbed MLA prefill: (block_table [Tq, max_blocks] int32, seq_lens [Tq] int32).

    Sequence b's new tokens are rows cu_seqlens_q[b]:cu_seqlens_q[b+1]; it has seq_lens[b] tokens in
    the cache (context + new), so its i-th new token attends to seq_lens[b] - q_len + i + 1 keys.
    No device-to-host reads (num_tokens = cu_seqlens_q[-1], known to the caller).
    """
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [B]
    seq_of_row = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=q_lens.device), q_lens,
                                         output_size=num_tokens)  # [Tq]
    index_in_seq = torch.arange(num_tokens, device=q_lens.device) - cu_seqlens_q[:-1][seq_of_row]
    row_lens = seq_lens[seq_of_row] - q_lens[seq_of_row] + index_in_seq + 1  # [Tq]
    return block_table[seq_of_row], row_lens.to(torch.int32)
