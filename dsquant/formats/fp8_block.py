"""FP8 block (DeepSeek-V3 native): tensor layout, quantize/dequantize, activation quantization,
and its quantization_config.

Tensors per Linear (out N, in K, block B = 128):
  weight           float8_e4m3fn [N, K]
  weight_scale_inv fp32 [ceil(N/B), ceil(K/B)]    W = fp8 * scale_inv per block, edge blocks partial
Activations ("activation_scheme": "dynamic"): quantized at run time per token per 128 channels,
  x [M, K] -> fp8 [M, K] + scale fp32 [M, ceil(K/128)], x ~= fp8 * scale.
quantization_config: {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [128, 128], modules_to_not_convert}. In a checkpoint with this config, a
module without `weight_scale_inv` is dense (DeepSeek-V3 keeps lm_head, the router and norms bf16).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dsquant.errors import ConfigError
from dsquant.formats.base import CONFIG_JSON, names, names_entries, not_converted

FP8_E4M3_MAX = 448.0
FP8_BLOCK = 128
FP8_ACT_SCALE_EPS = 1e-10
TENSORS = ("weight", "weight_scale_inv")


def fp8_block_shape(n: int, k: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    """The shape of weight_scale_inv for a weight [N, K]."""
    return (n + block - 1) // block, (k + block - 1) // block


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK):
    """w [N, K] -> (float8_e4m3fn [N, K], weight_scale_inv fp32 [ceil(N/B), ceil(K/B)]).

    Scale per block = absmax / 448; W ~= fp8 * scale_inv (DeepSeek-V3's layout).
    """
    n, k = w.shape
    nb, kb = fp8_block_shape(n, k, block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.to(torch.float32)
    blocks = padded.reshape(nb, block, kb, block)  # [nb, B, kb, B]
    amax = blocks.abs().amax(dim=(1, 3))  # [nb, kb]
    scale_inv = (amax / FP8_E4M3_MAX).clamp(min=1e-12)
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.reshape(nb * block, kb * block)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale_inv.contiguous()


def quantize_fp8_activations(x: torch.Tensor, group: int = FP8_BLOCK):
    """x [M, K] -> (float8_e4m3fn [M, K], scale fp32 [M, ceil(K/G)]): dynamic per-token, per-G-channel.

    scale = max(amax(|x_group|), 1e-10) / 448 and x ~= fp8 * scale: DeepSeek-V3's activation
    scheme ("activation_scheme": "dynamic"), which the FP8 GEMM kernels apply to their input.
    """
    m, k = x.shape
    ng = -(-k // group)
    padded = torch.zeros(m, ng * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.to(torch.float32)
    groups = padded.view(m, ng, group)  # [M, ng, G]
    amax = groups.abs().amax(-1).clamp(min=FP8_ACT_SCALE_EPS)  # [M, ng]
    # an IEEE division, as the kernels' div_rn: dividing by a Python scalar, torch on CUDA
    # multiplies by the reciprocal instead, a last-bit difference in about 1% of the scales that
    # moves the codes of values at a rounding tie
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    q = (groups / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.view(m, -1)[:, :k].to(torch.float8_e4m3fn).contiguous(), scale


def fp8_activation_roundtrip(x: torch.Tensor, group: int = FP8_BLOCK, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] -> the values a W8A8 FP8 GEMM multiplies (fp8 * scale), in `dtype` (default x's)."""
    k = x.shape[-1]
    q, s = quantize_fp8_activations(x.reshape(-1, k), group)
    deq = q.to(torch.float32) * s.repeat_interleave(group, dim=1)[:, :k]  # [M, K]
    return deq.to(dtype or x.dtype).reshape(x.shape)


def dequantize_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                         block: int = FP8_BLOCK) -> torch.Tensor:
    """float8_e4m3fn [N, K] + scale_inv [ceil(N/B), ceil(K/B)] -> [N, K] in `dtype`."""
    n, k = w.shape
    nb, kb = fp8_block_shape(n, k, block)
    if tuple(scale_inv.shape) != (nb, kb):
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {(nb, kb)} "
                         f"for a weight of shape {(n, k)} with {block}x{block} blocks")
    s = scale_inv.to(torch.float32).repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (w.to(torch.float32) * s).to(dtype)


@dataclass(frozen=True)
class Fp8BlockConfig:
    """A DeepSeek-V3 FP8 block quantization_config, validated (dynamic activations, 128 x 128 blocks)."""

    # substrings of module names kept dense (None: the config does not state it; (): null); vLLM's
    # ignored_layers is the same
    modules_to_not_convert: tuple[str, ...] | None = None
    ignored_layers: tuple[str, ...] | None = None
    fmt: str = "e4m3"
    source: str = CONFIG_JSON

    method: ClassVar[str] = "fp8"
    activation_scheme: ClassVar[str] = "dynamic"
    weight_block_size: ClassVar[tuple[int, int]] = (FP8_BLOCK, FP8_BLOCK)
    marker: ClassVar[str] = "weight_scale_inv"  # the tensor that tells a module is stored in this format

    @classmethod
    def from_dict(cls, q: dict, source: str = CONFIG_JSON) -> Fp8BlockConfig:
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ConfigError(f"{source}: fp8 activation_scheme {q.get('activation_scheme')!r} is not "
                              "supported (expected dynamic)")
        if list(q.get("weight_block_size") or [128, 128]) != [128, 128]:
            raise ConfigError(f"{source}: fp8 weight_block_size {q.get('weight_block_size')} is not "
                              "supported (expected [128, 128])")
        return cls(names(q, "modules_to_not_convert"), names(q, "ignored_layers"),
                   str(q.get("fmt") or "e4m3"), source)

    def to_dict(self) -> dict:
        return {"quant_method": "fp8", "fmt": self.fmt, "activation_scheme": "dynamic",
                "weight_block_size": list(self.weight_block_size),
                **names_entries(self.modules_to_not_convert, self.ignored_layers)}

    def scheme_for(self, prefix: str) -> Fp8BlockConfig | None:
        """This config for module `prefix`, or None where it stays dense (lm_head, not converted)."""
        if prefix == "lm_head" or not_converted(prefix, self.modules_to_not_convert, self.ignored_layers):
            return None
        return self
