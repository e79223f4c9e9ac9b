"""Launch plans of the absorbed MLA decode (mla_decode.py): its config, the heads per program, the
split-KV count, and the default config per cache dtype, head count and batch.

Every figure a constant was picked from is in the comment beside it (BENCHMARKS.md has the runs). The
policy reads this module's globals at call time, so a probe may set them (scripts/gpu.sh engineon sets
NARROW_SPLIT_TILES and SMALL_BATCH_SPLIT_TILES here).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from dsquant.runtime.kernels.attention.split_kv_merge import choose_num_splits, num_sms


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
    # a register cap per thread (Triton's maxnreg; 0: the compiler's choice). At 16 heads and 4 warps the kernels
    # take 200-253 registers, two programs a multiprocessor; 168 lets three run (sm_90 SASS compiled here: the
    # words kernel at 16- and 32-token tiles without spills). Not for > 16 heads: the wgmma form needs more.
    max_regs: int = 0


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


def launch_plan(q_nope, kv_cache, max_seq_len, config: MLADecodeConfig, block_table):
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
