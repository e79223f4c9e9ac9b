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
    path: str = "fused"  # W4A16: "fused" | "dequant" (dequantize + cuBLAS); FP8: "fused" | "weight_only"


DECODE_MAX_M = 64
# Tuned on the H200 (sm_90) with scripts/gemm_sweep.py: {(kind, m_bucket, n, k): GemmConfig}.
# m_bucket(M) is M rounded up to a power of two, clamped to [16, 4096].
TUNED_SM90: dict = {}


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
    """Smallest power of two that puts >= 2 programs per multiprocessor, keeping >= min_chunks each."""
    split = 1
    while tiles * split < 2 * sms and k_chunks // (split * 2) >= min_chunks and split < max_split:
        split *= 2
    return split


def _lookup(kind: str, m: int, n: int, k: int, device) -> GemmConfig | None:
    table = TUNED_SM90 if _gpu_family(device) == "sm90" else {}
    return table.get((kind, m_bucket(m), n, k))


def w4a16_config(m: int, n: int, k: int, group_size: int, device=None) -> GemmConfig:
    tuned = _lookup("w4a16", m, n, k, device)
    if tuned is not None:
        return tuned
    if m <= DECODE_MAX_M:
        bn, warps = (128, 8) if n >= 4096 else (64, 4)
        tiles = -(-n // bn)
        split = pick_split_k(tiles, k // group_size, device_sms(device), min_chunks=max(2, 256 // group_size))
        return GemmConfig(m_bucket(m), bn, split, warps, 4)
    if m >= 1024:
        return GemmConfig(128, 128, 1, 8, 3, path="dequant")
    return GemmConfig(64, 128, 1, 8, 3)


def fp8_config(m: int, n: int, k: int, device=None) -> GemmConfig:
    tuned = _lookup("fp8", m, n, k, device)
    if tuned is not None:
        return tuned
    if m <= DECODE_MAX_M:
        bn, warps = (128, 8) if n >= 4096 else (64, 4)
        tiles = -(-n // bn)
        split = pick_split_k(tiles, -(-k // 128), device_sms(device))
        return GemmConfig(m_bucket(m), bn, split, warps, 4)
    if m >= 1024:
        return GemmConfig(128, 128, 1, 8, 3)
    return GemmConfig(64, 128, 1, 4, 4)
