"""FP8 KV-cache layouts and their pure-torch quantize / dequantize.

The torch attention backend (layers/attention.py, the CPU path) stores and reads through these
functions. The Triton store kernel (kv_store_fp8.py) computes the same values in registers, and
the read kernels dequantize them the same way. So these functions are also the reference for
the kernel tests.

Numbers: e4m3 (torch.float8_e4m3fn, largest value 448), one dynamic fp32 scale per group of values
    amax  = max |x| over the group,   scale = max(amax, MIN_AMAX) / 448
    q     = e4m3(clamp(x / scale, -448, 448))     (round to nearest even)
    x    ~= q * scale
The scale is computed fresh from each token's values when the token is stored: nothing is
calibrated, and no value can overflow. An all-zero group stores zeros.

GQA / MHA (per token and kv head): for each layer there are four tensors,
    k_cache, v_cache  float8_e4m3fn [num_blocks, block_size, Hkv, D]
    k_scale, v_scale  float32       [num_blocks, block_size, Hkv]     (one scale per token and head)
so a token costs 2 x Hkv x (D + 4) bytes per layer instead of 2 x Hkv x 2D at bf16 (D = 128: 1.94x).

MLA (FlashMLA's token layout, one latent per token): each layer has one uint8 tensor
[num_blocks, block_size, W], with W = R + 4 * R/128 + 2 * P bytes per token:
    bytes [0, R)              R e4m3 latent values (R = kv_lora_rank, a multiple of 128)
    bytes [R, R + 4G)         G = R/128 fp32 scales, one per 128 latent values
    bytes [R + 4G, W)         the P rope-key values (P = qk_rope_head_dim), unquantized, 2 bytes each
DeepSeek (R 512, P 64): 512 + 16 + 128 = 656 bytes against 1152 at bf16 (1.756x the tokens).
The rope values are bf16 (FlashMLA's layout) unless the model runs in fp16; then they are fp16,
as the kernel tests under TRITON_INTERPRET use (the interpreter gets bf16 arithmetic wrong).
`mla_fp8_views` gives the three typed views of such a cache.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-8  # scale floor: an all-zero group divides by MIN_AMAX / 448, not by 0
MLA_GROUP = 128  # latent values per scale


def fp8_rope_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the rope values in the MLA FP8 cache of a model running in `dtype`."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def mla_fp8_groups(rank: int) -> int:
    if rank % MLA_GROUP:
        raise ValueError(f"the MLA FP8 KV cache needs kv_lora_rank a multiple of {MLA_GROUP}, got {rank}")
    return rank // MLA_GROUP


def mla_fp8_token_bytes(rank: int, rope: int) -> int:
    """Bytes per token of the MLA FP8 cache (656 for R 512, P 64)."""
    return rank + 4 * mla_fp8_groups(rank) + 2 * rope


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] -> (q float8_e4m3fn [..., N], scale float32 [...]): one scale over the last dim."""
    xf = x.float()
    amax = xf.abs().amax(-1).clamp(min=MIN_AMAX)  # [...]
    # a tensor divisor: torch divides by a Python scalar as a multiply by its reciprocal on CUDA (one
    # ulp off the IEEE quotient the store kernels compute with div_rn)
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., N] e4m3, scale [...] -> float32 [..., N]."""
    return q.float() * scale[..., None]


def mla_fp8_views(cache: torch.Tensor, rank: int, rope: int, rope_dtype: torch.dtype):
    """uint8 cache [num_blocks, block_size, W] -> (latent e4m3 [.., .., R], scales fp32 [.., .., G],
    rope [.., .., P] in rope_dtype), views of the same memory (strides in each view's elements).

    The three step through the same token rows (`rows_shared`), so the decode kernels take the scales' and
    the rope key's offsets from the latent's byte row (row / 4, row / 2)."""
    groups = mla_fp8_groups(rank)
    width = mla_fp8_token_bytes(rank, rope)
    if cache.dtype != torch.uint8 or cache.shape[-1] != width or cache.stride(-1) != 1:
        raise ValueError(f"MLA FP8 cache: expected uint8 [..., {width}] with a unit last stride, "
                         f"got {cache.dtype} {tuple(cache.shape)}")
    latent = cache.view(FP8_DTYPE)[..., :rank]
    scales = cache.view(torch.float32)[..., rank // 4:rank // 4 + groups]
    start = (rank + 4 * groups) // 2
    return latent, scales, cache.view(rope_dtype)[..., start:start + rope]


def rows_shared(*views: torch.Tensor) -> bool:
    """Whether views step through the same rows (equal byte strides in every dim but the last)."""
    return len({tuple(st * v.element_size() for st in v.stride()[:-1]) for v in views}) == 1


def quantize_mla_fp8(kv_c: torch.Tensor, k_pe: torch.Tensor, rope_dtype: torch.dtype) -> torch.Tensor:
    """kv_c [T, R] (normed latent), k_pe [T, P] (rope applied) -> the tokens' cache rows, uint8 [T, W]."""
    t, rank = kv_c.shape
    groups = mla_fp8_groups(rank)
    q, scale = quantize_fp8(kv_c.reshape(t, groups, MLA_GROUP))  # [T, G, 128], [T, G]
    return torch.cat([q.reshape(t, rank).view(torch.uint8), scale.contiguous().view(torch.uint8),
                      k_pe.to(rope_dtype).contiguous().view(torch.uint8)], dim=-1)


def dequantize_mla_fp8(rows: torch.Tensor, rank: int, rope: int, rope_dtype: torch.dtype) -> torch.Tensor:
    """Cache rows uint8 [..., W] -> float32 [..., R + P]: the latent (q * scale), then the rope key."""
    lead = rows.shape[:-1]
    latent, scales, pe = mla_fp8_views(rows.contiguous(), rank, rope, rope_dtype)
    groups = scales.shape[-1]
    lat = dequantize_fp8(latent.reshape(*lead, groups, MLA_GROUP), scales).reshape(*lead, rank)
    return torch.cat([lat, pe.float()], dim=-1)
