"""Launch configurations for the W4A16 and FP8 block GEMMs, chosen by shape, never tuned at run time.

`GemmConfig` is what a launcher needs: tile sizes, split-K factor, warps, pipeline stages and, for
W4A16, the path ("fused" dequant-GEMM, or "dequant" = dequantize to bf16 then cuBLAS). A config is
picked by `w4a16_config` / `fp8_config` from the token count M and the weight shape: an entry of
the tuned table for this GPU family if there is one (measured offline with
`scripts/gemm_sweep.py` on that GPU, keyed by M bucket and (N, K)), else a heuristic that gives
decode sizes enough split-K programs to cover the multiprocessors twice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # tokens per tile (>= 16: the MMA's narrow side)
    block_n: int  # output channels per tile
    split_k: int  # programs sharing one output tile along K
    num_warps: int
    num_stages: int
    path: str = "fused"  # W4A16: "gemv" | "gemv_kblock" | "fused" | "dequant" (dequantize + cuBLAS); FP8: "fused" | "weight_only"
    k_chunks: int = 1  # "gemv_kblock" (W4A16 and FP8): 128-channel chunks / blocks a program loads per step


DECODE_MAX_M = 64
# W4A16 decode batches up to this many tokens run the GEMV (w4a16_gemv.py, which takes up to 4):
# its FMA work grows with M, and scripts/gemv_sweep.py on the H200 had it beat the tiled MMA kernel
# at M = 1 and 2 on every bench shape (7168 x 18432: 35.5 / 52.5 us against 78 us) but not at M = 4.
GEMV_MAX_M = 2
# Tuned on the H200 (sm_90, 2026-11-29, triton 3.6) with scripts/gemm_sweep.py, CUDA-graph medians
# in the comments: {(kind, m_bucket, n, k): GemmConfig}; m_bucket(M) is M rounded up to a power of
# two, clamped to [16, 4096]. The sweep ran out of time on 7168 x 18432 after M = 1 and 64 (w4a16)
# and M = 1 (fp8); its other buckets use the heuristic below.
TUNED_SM90: dict = {
    ('fp8', 16, 2816, 2048): GemmConfig(16, 64, 8, 4, 4, 'weight_only'),  # 6.6 us
    ('fp8', 64, 2816, 2048): GemmConfig(64, 64, 4, 4, 4, 'weight_only'),  # 11.1 us
    ('fp8', 256, 2816, 2048): GemmConfig(64, 128, 1, 4, 4, 'fused'),  # 15.4 us
    ('fp8', 1024, 2816, 2048): GemmConfig(64, 128, 1, 4, 4, 'fused'),  # 41.6 us
    ('fp8', 4096, 2816, 2048): GemmConfig(64, 256, 1, 8, 3, 'fused'),  # 123.8 us
    ('fp8', 16, 10944, 2048): GemmConfig(16, 64, 2, 4, 4, 'weight_only'),  # 13.7 us
    ('fp8', 64, 10944, 2048): GemmConfig(64, 64, 1, 4, 4, 'weight_only'),  # 21.7 us
    ('fp8', 256, 10944, 2048): GemmConfig(64, 128, 1, 4, 4, 'fused'),  # 37.7 us
    ('fp8', 1024, 10944, 2048): GemmConfig(64, 128, 1, 4, 4, 'fused'),  # 117.8 us
    ('fp8', 4096, 10944, 2048): GemmConfig(64, 256, 1, 8, 3, 'fused'),  # 409.9 us
    ('fp8', 16, 4096, 7168): GemmConfig(16, 64, 8, 4, 4, 'weight_only'),  # 15.5 us
    ('fp8', 64, 4096, 7168): GemmConfig(64, 64, 4, 4, 4, 'weight_only'),  # 22.9 us
    ('fp8', 256, 4096, 7168): GemmConfig(64, 128, 1, 4, 4, 'fused'),  # 44.8 us
    ('fp8', 1024, 4096, 7168): GemmConfig(64, 256, 1, 8, 3, 'fused'),  # 126.0 us
    ('fp8', 4096, 4096, 7168): GemmConfig(64, 256, 1, 8, 3, 'fused'),  # 493.9 us
    ('fp8', 16, 18432, 7168): GemmConfig(16, 64, 4, 4, 4, 'weight_only'),  # 56.4 us
    ('w4a16', 16, 2816, 2048): GemmConfig(16, 64, 8, 4, 4, 'fused'),  # 7.4 us
    ('w4a16', 64, 2816, 2048): GemmConfig(64, 64, 4, 4, 4, 'fused'),  # 13.8 us
    ('w4a16', 256, 2816, 2048): GemmConfig(128, 128, 1, 8, 3, 'dequant'),  # 11.3 us
    ('w4a16', 1024, 2816, 2048): GemmConfig(128, 128, 1, 8, 3, 'dequant'),  # 21.2 us
    ('w4a16', 4096, 2816, 2048): GemmConfig(128, 128, 1, 8, 3, 'dequant'),  # 73.2 us
    ('w4a16', 16, 10944, 2048): GemmConfig(16, 64, 2, 4, 4, 'fused'),  # 17.9 us
    ('w4a16', 64, 10944, 2048): GemmConfig(64, 256, 2, 8, 4, 'fused'),  # 34.9 us
    ('w4a16', 256, 10944, 2048): GemmConfig(128, 128, 1, 8, 3, 'dequant'),  # 35.5 us
    ('w4a16', 1024, 10944, 2048): GemmConfig(128, 128, 1, 8, 3, 'dequant'),  # 83.6 us
    ('w4a16', 4096, 10944, 2048): GemmConfig(128, 128, 1, 8, 3, 'dequant'),  # 279.7 us
    ('w4a16', 16, 4096, 7168): GemmConfig(16, 128, 8, 4, 4, 'fused'),  # 20.4 us
    ('w4a16', 64, 4096, 7168): GemmConfig(64, 128, 8, 4, 4, 'fused'),  # 34.9 us
    ('w4a16', 256, 4096, 7168): GemmConfig(128, 128, 1, 8, 3, 'dequant'),  # 51.1 us
    ('w4a16', 1024, 4096, 7168): GemmConfig(128, 128, 1, 8, 3, 'dequant'),  # 99.6 us
    ('w4a16', 4096, 4096, 7168): GemmConfig(128, 128, 1, 8, 3, 'dequant'),  # 348.9 us
    ('w4a16', 16, 18432, 7168): GemmConfig(16, 64, 8, 4, 4, 'fused'),  # 84.4 us
    ('w4a16', 64, 18432, 7168): GemmConfig(64, 128, 8, 4, 4, 'fused'),  # 159.1 us
}


def device_sms(device: torch.device | str | None = None) -> int:
    if not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device or torch.cuda.current_device()).multi_processor_count


def _gpu_family(device=None) -> str:
    if not torch.cuda.is_available():
        return "cpu"
    major, _ = torch.cuda.get_device_capability(device)
    return f"sm{major}0"


def m_bucket(m: int) -> int:
    """Token-count bucket a tuned entry covers: 16, 32, 64 (decode), 128, ..., 4096 (and above)."""
    return min(max(16, triton_next_pow2(m)), 4096)


def triton_next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def pick_split_k(tiles: int, k_chunks: int, sms: int, min_chunks: int = 4, max_split: int = 16) -> int:
    """Smallest power of two giving >= 2.5 programs per multiprocessor, keeping >= min_chunks each.

    Decode is bound by loads in flight, so the H200 sweep favoured 300-500 programs (132 SMs).
    """
    split = 1
    while 2 * tiles * split < 5 * sms and k_chunks // (split * 2) >= min_chunks and split < max_split:
        split *= 2
    return split


def _lookup(kind: str, m: int, n: int, k: int, device) -> GemmConfig | None:
    table = TUNED_SM90 if _gpu_family(device) == "sm90" else {}
    return table.get((kind, m_bucket(m), n, k))


def fit_split(steps: int, per_split: int, start: int = 8) -> int:
    """The largest power-of-two split-K <= start that leaves each split >= per_split K steps."""
    split = start
    while split > 1 and steps < per_split * split:
        split //= 2
    return split


def w4a16_gemv_config(m: int, n: int, k: int, group_size: int, device=None) -> GemmConfig:
    """Plain-order GEMV config: 64 channels per program at M = 1, 32 above, 2 warps, split-K 8
    (fewer when a split would get under 2 groups). On the H200 sweep (12 shape x M cases) every
    case's times were within 10% across the top configs, and this one within 6% of each case's best."""
    return GemmConfig(triton_next_pow2(m), 64 if m == 1 else 32, fit_split(k // group_size, 2), 2, 1, path="gemv")


# The MMA kernel (w4a16_mma.py; measured on the k-sliced code order the paired one replaced) on the H200
# (2026-12-03, triton 3.6, scripts/w4a16_mma_probe.py
# over block_n 64/128, split 1-16, 3-4 stages; graph medians at the bucket's largest measured M in the
# comments), {(m_bucket, n, k): GemmConfig}. Shapes not listed take _sliced_config's rule, which the
# same sweep favoured: 64 channels and split 8 to 16 tokens, 128 channels above, >= 4 chunks a split.
TUNED_SLICED_SM90: dict = {
    (16, 18432, 7168): GemmConfig(16, 64, 8, 4, 3),  # 50.9 us
    (16, 4096, 7168): GemmConfig(16, 128, 8, 4, 3),  # 14.3 us
    (16, 10944, 2048): GemmConfig(16, 128, 4, 4, 3),  # 12.1 us
    (16, 2816, 2048): GemmConfig(16, 64, 8, 4, 3),  # 8.0 us
    (64, 18432, 7168): GemmConfig(64, 128, 4, 4, 3),  # 101.9 us
    (64, 4096, 7168): GemmConfig(64, 128, 8, 4, 3),  # 23.5 us
    (64, 10944, 2048): GemmConfig(64, 128, 2, 4, 3),  # 21.6 us
    (64, 2816, 2048): GemmConfig(64, 64, 4, 4, 4),  # 11.9 us
    (128, 18432, 7168): GemmConfig(64, 128, 4, 4, 3),  # 163.1 us
    (128, 4096, 7168): GemmConfig(64, 128, 4, 4, 3),  # 32.7 us
    (128, 10944, 2048): GemmConfig(64, 128, 1, 4, 3),  # 30.8 us
    (128, 2816, 2048): GemmConfig(64, 128, 4, 4, 4),  # 15.5 us
    # V2-Lite's decode shapes (fused q + kv_a, o_proj, layer 0's fused gate/up), from the H100 run of
    # `w4a16_mma_probe.py --shapes 2048x3648,2048x2048,2048x21888 --m 16,32,64` (2026-12-06, twenty-first
    # session; graph replays of one L2-warm weight; the rule's config in brackets). The 64-sequence engine
    # did not move with them (7280 against 7268 tok/s): there the weights come from HBM.
    (16, 3648, 2048): GemmConfig(16, 128, 4, 4, 3),  # 7.95 us (8.73)
    (32, 3648, 2048): GemmConfig(32, 128, 4, 4, 3),  # 9.65 us (11.64)
    (64, 3648, 2048): GemmConfig(64, 128, 4, 4, 3),  # 12.47 us (14.86)
    (16, 2048, 2048): GemmConfig(16, 128, 8, 4, 3),  # 7.21 us (7.58)
    (32, 2048, 2048): GemmConfig(32, 64, 4, 4, 3),  # 8.69 us (11.39)
    (64, 2048, 2048): GemmConfig(64, 64, 4, 4, 4),  # 10.43 us (14.40)
    (16, 21888, 2048): GemmConfig(16, 128, 2, 4, 4),  # 15.97 us (21.73)
    (32, 21888, 2048): GemmConfig(32, 128, 2, 4, 3),  # 19.01 us (the rule's)
    (64, 21888, 2048): GemmConfig(64, 128, 1, 4, 3),  # 29.51 us (38.42)
}


# Decode sizes where the GEMV over the kernel code order (w4a16_gemv._w4a16_gemv_sliced_kernel) beats the
# MMA kernel's 16-token tile, from `scripts/gemv_sweep.py --quick --plain --v2lite --m 1,2` on the H200
# (2026-12-04, graph medians, sliced GEMV / MMA default / plain-order GEMV, us): M = 1 on every shape
# within 4% or better (7168x18432 37.2 / 43.7 / 36.3; 2048x3648 5.22 / 6.51; 2048x2048 4.37 / 5.81;
# 512x4096 3.29 / 4.35; 2048x21888 14.1 / 16.0; 7168x4096 10.9 / 10.4; 2048x10944 9.08 / 8.83); M = 2
# only on the small shapes (2048x2048 5.20 / 5.82, 2048x3648 6.17 / 6.78, 512x4096 3.93 / 4.38; on
# 7168x18432 55.5 / 44.2).
SLICED_GEMV_M2_MAX_WORK = 8 << 20  # N * K


def sliced_gemv_config(m: int, n: int, k: int) -> GemmConfig:
    """The sliced-order GEMV's config, by the same sweep: 2 warps, 32 channels per program up to N =
    4096 (64 above, at M = 1), split-K 8 chunks-permitting (>= 2 chunks a split), none at <= 4 chunks."""
    chunks = k // 128
    split = 1 if chunks <= 4 else fit_split(chunks, 2)
    return GemmConfig(triton_next_pow2(m), 64 if m == 1 and n > 4096 else 32, split, 2, 1, path="gemv")


# The K-block GEMV (w4a16_gemv_kblock.py) on the small V2-Lite projections at M = 1, from
# `scripts/gemv_sweep.py --quick --v2lite --m 1 --kblock --no-gemv` on the H200 (2026-12-04, after the
# one-lop3 change; K-block / one-chunk GEMV / tinygemm, us): 2048x2048 3.62 / 4.35 / 3.32, 512x4096
# 2.36 / 3.11 / 2.55, 2048x3648 4.61 / 4.91 / 3.86, 2048x2816 4.52 / 4.66 / 3.57; 16 channels, 4 warps,
# all of K in one step, no split. It loses from 2048x10944 up (8.44 / 7.86) and at K = 7168.
KBLOCK_MAX_K = 2048
KBLOCK_MAX_N = 4096


def _sliced_config(m: int, n: int, k: int, device) -> GemmConfig:
    if m == 1 and k <= KBLOCK_MAX_K and n <= KBLOCK_MAX_N:
        return GemmConfig(1, 16, 1, 4, 1, path="gemv_kblock", k_chunks=min(16, triton_next_pow2(k // 128)))
    if m == 1 or (m == 2 and n * k <= SLICED_GEMV_M2_MAX_WORK):
        return sliced_gemv_config(m, n, k)
    table = TUNED_SLICED_SM90 if _gpu_family(device) == "sm90" else {}
    tuned = table.get((m_bucket(m), n, k))
    if tuned is not None:
        return tuned
    if m >= 256:
        return GemmConfig(128, 128, 1, 8, 3, path="dequant")
    if m <= 16:
        return GemmConfig(16, 64, fit_split(k // 128, 4), 4, 3)
    return GemmConfig(min(m_bucket(m), 64), 128, fit_split(k // 128, 8), 4, 3)


def w4a16_config(m: int, n: int, k: int, group_size: int, device=None, sliced: bool = False) -> GemmConfig:
    """The path and launch config for M tokens; `sliced`: the weight is in the paired code order (int4_paired.py).

    Sliced weights take the K-block GEMV at M = 1 on small weights (KBLOCK_MAX_K / _N), the
    one-chunk sliced-order GEMV at M = 1 otherwise and at M = 2 on small weights
    (SLICED_GEMV_M2_MAX_WORK; the sweeps are in the comments above), and the MMA kernel at every
    other M < 256."""
    if sliced:
        return _sliced_config(m, n, k, device)
    if m <= GEMV_MAX_M:
        return w4a16_gemv_config(m, n, k, group_size, device)
    tuned = _lookup("w4a16", m, n, k, device)
    if tuned is not None:
        return tuned
    if m <= DECODE_MAX_M:  # the sweep's usual winner: 64-channel tiles, 4 warps, split-K
        split = pick_split_k(-(-n // 64), k // group_size, device_sms(device),
                             min_chunks=max(2, 256 // group_size))
        return GemmConfig(m_bucket(m), 64, split, 4, 4)
    if m >= 256:  # dequantize + cuBLAS won every M >= 256 bucket of the sweep
        return GemmConfig(128, 128, 1, 8, 3, path="dequant")
    return GemmConfig(64, 128, 1, 8, 3)


def fp8_tiled_config(m: int, n: int, k: int, device=None) -> GemmConfig:
    """Config of the Triton tiled FP8 GEMM (fp8_gemm.py) alone: the table, else the heuristic."""
    tuned = _lookup("fp8", m, n, k, device)
    if tuned is not None:
        return tuned
    if m <= DECODE_MAX_M:  # weight-only (bf16 MMA) beat in-GEMM activation quant at every decode size
        split = pick_split_k(-(-n // 64), -(-k // 128), device_sms(device))
        return GemmConfig(m_bucket(m), 64, split, 4, 4, path="weight_only")
    if m >= 1024:
        return GemmConfig(64, 256, 1, 8, 3)
    return GemmConfig(64, 128, 1, 4, 4)


# FP8 paths (GemmConfig.path), chosen by fp8_config from M and the weight shape:
#   "gemv"    fp8_gemv.py, M <= FP8_GEMV_MAX_M: no MMA, W8A8 in fp32 registers, split-K
#   "cublas"  torch._scaled_mm blockwise (cuBLASLt, sm_90 only) for M >= FP8_CUBLAS_MIN_M on
#             shapes cuBLAS takes (N and K multiples of 128); Triton tiled kernel if it refuses
#   "fused" / "weight_only"  the Triton tiled kernel (fp8_gemm.py); "weight_only" is a tiling
#             hint of the sweep, never a change of numerics
#   "gemv_kblock"  fp8_gemv_kblock.py, M <= 2, K % 128 == 0: x quantized once, then k_chunks
#             128-blocks a step, elementwise accumulation; fp8_config's choice for one token on sm_90
FP8_GEMV_MAX_M = 4  # the FP8 GEMV kernel's limit
# The decode choice between the FP8 GEMV and cuBLAS (rows padded to 16), from the H200 run of
# scripts/gemv_sweep.py --fp8 and dsquant bench gemm (2026-11-29, graph replays): the GEMV wins
# while M * N * K is small (M = 1: 2816x2048 6.0 vs ~11 us, 4096x7168 14.3 vs ~17 us; M = 2:
# 2816x2048 7.9 us), cuBLAS above (18432x7168: GEMV 79.5 us at M = 1, cuBLAS 49.6 us at M = 4;
# 4096x7168 at M = 2: GEMV 21.5 us, cuBLAS ~18 us).
FP8_GEMV_MAX_WORK = 1 << 25  # M * N * K
FP8_CUBLAS_MIN_M = 1


def fp8_gemv_config(m: int, n: int, k: int, device=None) -> GemmConfig:
    """GEMV config: 32 channels per program, 4 warps, split-K 4 (fewer when K has under 8
    blocks). Over the H200 sweep of 30 configs x 4 shapes it stayed within 15% of each case's
    best at M = 1 and 6% at M = 2; block_m is M rounded up to 1, 2 or 4."""
    return GemmConfig(triton_next_pow2(m), 32, fit_split(-(-k // 128), 2, start=4), 4, 1, path="gemv")


def fp8_gemv_candidates(m: int) -> list[GemmConfig]:
    """GEMV configs worth sweeping on a GPU (block_n x warps x split-K) for M <= 4 tokens."""
    bm = triton_next_pow2(m)
    return [GemmConfig(bm, bn, split, warps, 1, path="gemv")
            for bn in (32, 64, 128) for warps in (2, 4, 8) for split in (1, 2, 4, 8, 16)
            if bn * 128 // (32 * warps) <= 64]  # <= 64 weight values per thread: no spills (ptxas)


def fp8_cublas_eligible(m: int, n: int, k: int, device=None) -> bool:
    """Blockwise torch._scaled_mm serves this call: sm_90, M >= FP8_CUBLAS_MIN_M, K % 128 == 0 and
    N % 16 == 0 (cuBLASLt's 16-byte alignment). A partial last block of 128 output channels is
    taken: on the H200 `bench gemm`'s _scaled_mm ran 2048 x 10944 (85.5 blocks) at M = 4 / 64 in
    9.2 / 8.7 us at the FP8 rounding error of every other shape, where N % 128 sent it to the Triton
    tiles (30.9 / 60.3 us); test_fp8_all_paths_at_deepseek_shapes_gpu checks it against the product."""
    return (m >= FP8_CUBLAS_MIN_M and n % 16 == 0 and k % 128 == 0
            and _gpu_family(device) == "sm90")


def fp8_kblock_config(n: int, k: int) -> GemmConfig:
    """K-block GEMV config for one token (fp8_gemv_kblock.py; x quantized by its own launch):
    16 channels a program, 4 warps. On the H200 sweep (docs/bench/fp8dec-kblock-*, quant launch
    included) 4 blocks a step without split-K was best or within 10% of it, except where few
    programs (N <= 4096) meet a long K: 8 blocks a step at 1024 <= K < 4096 (2048 x 2048: 6.0 against
    6.6 us) and split-K 2 at K >= 4096 (4096 x 7168: 13.7 against 16.5 us)."""
    k_blocks, split = 4, 1
    if n <= 4096 and k >= 4096:
        split = 2
    elif n <= 4096 and k >= 1024:
        k_blocks = 8
    return GemmConfig(1, 16, split, 4, 1, path="gemv_kblock", k_chunks=k_blocks)


def kblock_fuses_quant(m: int, n: int, k: int) -> bool:
    """Whether the K-block GEMV quantizes x itself (FUSE_QUANT) when the caller leaves it open: one
    token on a weight of N <= 4096 and K <= 2048, where skipping the quant launch (~1.5 us) beats
    every program redoing the quantization (H200, scripts/fp8_decode_probe.py, 2026-12-04: 3648 x 2048
    5.9 against 6.9 us, 2048 x 2048 5.0 against 6.1, 4096 x 512 3.1 against 4.3); larger weights run
    more programs, each redoing it, and lose (21888 x 2048 22.3 against 17.8, 18432 x 7168 54.6 against
    45.8, 4096 x 7168 20.3 against 13.7), as do two tokens (8.9-176 against 7.5-17.8 at 2048 x 2048)."""
    return m == 1 and n <= 4096 and k <= 2048


def fp8_config(m: int, n: int, k: int, device=None) -> GemmConfig:
    """The FP8 path and launch config for M tokens: the K-block GEMV for one token on sm_90 (it beat
    the GEMV and cuBLAS at every whole-block DeepSeek shape on the H200, 1.26-1.37x at 18432 x 7168
    and 21888 x 2048), else the GEMV, cuBLAS blockwise, or the Triton tiles."""
    if m == 1 and k % 128 == 0 and _gpu_family(device) == "sm90":
        return fp8_kblock_config(n, k)
    cublas = fp8_cublas_eligible(m, n, k, device)
    if m <= FP8_GEMV_MAX_M and (m * n * k <= FP8_GEMV_MAX_WORK or (not cublas and m <= 2)):
        return fp8_gemv_config(m, n, k, device)
    if cublas:
        return GemmConfig(128, 128, 1, 8, 3, path="cublas")  # tiles only used if cuBLAS refuses
    return fp8_tiled_config(m, n, k, device)
