"""Rotary position embedding: inverse frequencies (plain, linear, Llama-3, YaRN), cos/sin, apply.

YaRN follows the paper (arXiv 2309.00071) as DeepSeek-V2/V3 configure it: frequencies blended
between interpolation and extrapolation by a linear ramp over the correction range from
beta_fast/beta_slow, and an attention factor mscale(factor, mscale) / mscale(factor,
mscale_all_dim) multiplied into cos/sin. DeepSeek also multiplies the softmax scale by
mscale(factor, mscale_all_dim)^2: `softmax_scale_factor` below.
"""
from __future__ import annotations

import math

import torch

from dsquant.config import RopeConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    orig = rope.original_max_position_embeddings
    if rope.attention_factor is not None:
        attn_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attn_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attn_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep_extrapolation = 1 - ramp
    inv_freq = interpolation * (1 - keep_extrapolation) + extrapolation * keep_extrapolation
    return inv_freq, attn_factor


def _llama3_inv_freq(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    orig = rope.original_max_position_embeddings
    low_wavelen = orig / rope.low_freq_factor
    high_wavelen = orig / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inv_freq_and_attention_factor(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] fp32 and the factor multiplied into cos/sin."""
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(rope, inv_freq)
    return inv_freq, 1.0


def softmax_scale_factor(rope: RopeConfig) -> float:
    """DeepSeek's extra softmax-scale factor under YaRN: mscale(factor, mscale_all_dim)^2."""
    if rope.rope_type == "yarn" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        return m * m
    return 1.0


def cos_sin_cache(rope: RopeConfig, dim: int, max_positions: int,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """cos/sin per position, fp32 [max_positions, dim] = cat(cos [.., dim/2], sin [.., dim/2]).

    The attention factor is already multiplied in. Kernels take this cache as input.
    """
    inv_freq, attn_factor = inv_freq_and_attention_factor(rope, dim)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [P, dim/2]
    cache = torch.cat([freqs.cos() * attn_factor, freqs.sin() * attn_factor], dim=-1)
    return cache.to(device) if device is not None else cache


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [..., T, H, D] by cos/sin [..., T, D/2] (broadcast over heads H).

    interleaved=False: neox/Llama rotate-half pairs (i, i + D/2).
    interleaved=True: DeepSeek pairs (2i, 2i + 1); the output is de-interleaved, [rotated evens,
    rotated odds], as DeepSeek's reference code and transformers produce it.
    """
    cos = cos.unsqueeze(-2).to(torch.float32)  # [..., T, 1, D/2]
    sin = sin.unsqueeze(-2).to(torch.float32)
    xf = x.to(torch.float32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)
