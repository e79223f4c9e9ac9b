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

from dataclasses import dataclass

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
from dsquant.runtime.kernels.attention.split_kv_merge import choose_num_splits, merge_splits, num_sms, split_bounds

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch parameters; 0 (block_h, num_warps, num_splits) means "choose by heuristic"."""
    block_h: int = 0
    block_n: int = 32
    num_warps: int = 0
    num_stages: int = 2
    num_splits: int = 0
    fold_fp8_scales: bool = False  # FP8 cache: mla_decode_fp8.py's kernel (R <= 512) instead of dequantized
    # tiles; off: on the H200 it ran 5-16% slower (BENCHMARKS.md, FP8 KV cache)
    fp8_f16_dots: bool = False  # FP8 cache: both dots in fp16, the tiles dequantized in fp16 (an experiment)
    fp8_prefetch: bool = False  # FP8 cache: mla_decode_fp8_prefetch.py's kernel (the next tile loaded ahead)
    fp8_words: bool = False  # FP8 cache: mla_decode_fp8_words.py's kernel (R <= 512: codes read as int32 words,
    # scales folded, fp16 dots); takes precedence over the two above
    min_split_tiles: int = 4  # a split covers at least this many BLOCK_N tiles (split_kv_merge.split_bounds)
    # the words kernel only: rescale its accumulators only in tiles where a head's maximum grew by more than
    # LAZY_TAU (mla_decode_fp8_words.py). In the bf16 / dequantizing kernel the same ran 0.83-0.99x as fast on an
    # H100 (16 and 128 heads, B 1-64, L 4096-32768; a probe of the thirty-first session) and was removed
    lazy_rescale: bool = False


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


# a context of 64 x 256 tokens or more goes in splits of at least 256 (split_kv_merge.split_bounds): batch 1
# launches 256 splits, which at 128K read 512 tokens each (1.0 -> 1.8 TB/s against 64 splits), and at 32K
# 128 live splits of 256 tokens ran 36.4 us per layer against 43.0 for 256 of 128 (H200, mla_long_sweep.py)
LONG_SPLIT_TOKENS = 256


def default_block_h(num_heads: int) -> int:
    """Heads per program: 16 fills the dot's rows for V2-Lite's 16 heads; with V3's 128 heads the kernel
    is bound by tensor-core work (2 x 1088 FLOP per head per 1152-byte token), and 64 heads per
    latent tile ran about 2x faster than 32 on an H200 (bench attention --sweep, 2026-11-29)."""
    return 16 if num_heads <= 16 else 64


def choose_mla_splits(programs: int, block_h: int, block_n: int, max_seq_len: int, sms: int) -> int:
    """Splits per sequence, a power of two (whole waves on 132 SMs; 9 splits ran 10% slower than 8).

    With 16 heads per program the kernel is bandwidth-bound: about two waves of programs, up to 256
    splits (the layer core at 128K context: batch 1 81.7 us with 256 splits against 160.7 with 64,
    batch 2 best at 128, batch 4 at 64; scripts/mla_long_sweep.py, H200, 2026-12-02), and splits of
    512 to 1024 tokens (at least 32 when the context allows) keep enough loads in flight, and their
    partial outputs (block_h x 512 float32, written then read back by the merge) stay near a tenth
    of the latent read. With 64 heads per
    program it is bound by tensor-core work and splits only need to fill the SMs. Picked from the
    H200 sweep of 2026-11-29 (BENCHMARKS.md, `dsquant bench attention --sweep`).
    """
    splits = choose_num_splits(programs, max_seq_len, 4 * block_n, sms, waves=2 if block_h <= 16 else 4,
                               max_splits=256 if block_h <= 16 else 64)
    if block_h <= 16:
        splits = max(splits, min(32, max_seq_len // 512))
        # a few sequences: at least 16 splits (or a wave), whatever max_seq_len says. Each sequence
        # sizes its own splits (split_kv_merge.split_bounds), so a short one leaves the rest empty, and
        # a graph captured at a small max_model_len still reads a 4096-token context 16 ways (H200,
        # batch 1, 600 tokens: 8-16 splits 17.3-17.7 us per layer, 4 splits 20.9; 4096 tokens: 16-32
        # splits 23-26 us, 8 splits 40 us; scripts/mla_sweep.py)
        splits = max(splits, min(16, -(-2 * sms // programs)))
    return 1 << (max(1, splits).bit_length() - 1)


# FP8 cache with <= 16 heads: the prefetching kernel over 16-token tiles, 747.8 us at V2-Lite's 16 heads, B 32,
# L 32768 against 849.5 for the dequantizing kernel's default (H200, scripts/kvfp8_sweep.py, 2026-12-02)
FP8_CONFIG = MLADecodeConfig(block_n=16, fp8_prefetch=True)
# bf16 cache, > 16 heads (64 per program): 64-token tiles, 1287.7 us at V3's 128 heads, B 32, L 32768 against
# 1835.8 with 32 (H200, bench attention --sweep, 2026-11-29 and 2026-12-02 alike; faster at every bench shape
# but B 1 L 4096)
WIDE_CONFIG = MLADecodeConfig(block_n=64)


# bf16 cache at <= 16 heads: the fewest 32-token tiles a split covers, 1 up to SMALL_BATCH sequences, else 4.
# H100, 16 heads, us per layer (gpu.sh mlashort: scripts/mla_short_sweep.py, 2026-12-06), tiles 1 / 4:
# B 1: 13.8 / 19.7 at 128 tokens, 15.7 / 21.2 at 600, 19.9 / 23.1 at 2048; B 4: 15.7 / 21.5, 18.4 / 23.2,
# 23.4 / 25.3; B 16: 24.1 / 29.5 at 128 but 36.1 / 30.8 at 600 and 49.3 / 45.4 at 2048.
NARROW_SPLIT_TILES = 4
SMALL_BATCH_SPLIT_TILES = 1
SMALL_BATCH = 4


def default_config(kv_cache: torch.Tensor, heads: int, batch: int | None = None) -> MLADecodeConfig:
    """The launch config when the caller gives none: FP8_CONFIG for an FP8 cache at <= 16 heads,
    WIDE_CONFIG for a bf16 cache at more, else 32-token tiles with min_split_tiles SMALL_BATCH_SPLIT_TILES
    for at most SMALL_BATCH sequences (batch None: more), NARROW_SPLIT_TILES for more."""
    fp8 = kv_cache.dtype == torch.uint8
    if fp8 and heads <= 16:
        return FP8_CONFIG
    if not fp8 and heads > 16:
        return WIDE_CONFIG
    small = batch is not None and batch <= SMALL_BATCH
    return MLADecodeConfig(min_split_tiles=SMALL_BATCH_SPLIT_TILES if small else NARROW_SPLIT_TILES)


def _launch_plan(q_nope, kv_cache, max_seq_len, config: MLADecodeConfig, block_table):
    """(block_h, num_warps, head_blocks, splits) of a launch."""
    batch, heads, _ = q_nope.shape
    if max_seq_len is None:
        max_seq_len = block_table.shape[1] * kv_cache.shape[1]
    block_h = config.block_h or default_block_h(heads)
    num_warps = config.num_warps or (4 if block_h <= 16 else 8)  # the [block_h, R] fp32 accumulator lives in registers
    head_blocks = triton.cdiv(heads, block_h)
    splits = config.num_splits or choose_mla_splits(batch * head_blocks, block_h, config.block_n, max_seq_len,
                                                    num_sms(q_nope.device))
    return block_h, num_warps, head_blocks, splits


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
    plan = _launch_plan(q_nope, kv_cache, max_seq_len, config, block_table)
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
    plan = _launch_plan(q_nope, kv_cache, max_seq_len, config, block_table)
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
