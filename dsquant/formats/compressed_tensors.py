"""compressed-tensors (llm-compressor): pack-quantized INT4 and float-quantized FP8, per config group.

pack-quantized (strategy group or channel), per Linear (out N, in K, group G):
  weight_packed     int32 [N, K/8]   signed codes q in [-8, 7] stored as q + 8, 8 per int32 along
                                     K, element i of each 8 in bits 4i..4i+3
  weight_scale      [N, K/G]         (channel: [N, 1])
  weight_zero_point int32 [N/8, K/G] packed along N the same way (absent when symmetric: zero 0)
  weight_shape      int64 [2]        (N, K)
  W[n, k] = (q - z) * s with q, z the signed values.
float-quantized FP8: weight e4m3 [N, K]; weight_scale fp32 [ceil(N/128), ceil(K/128)] (block),
  [N, 1] (channel) or [1] (tensor); W = weight * scale.
quantization_config: {quant_method: compressed-tensors, format, quantization_status,
config_groups: {name: {targets, weights, input_activations, output_activations, format}},
ignore, kv_cache_scheme}. A target is "Linear" (every Linear but lm_head), "re:<regex>" or a
module name (or its suffix); a module in `ignore` stays dense, else the first group that targets
it decides. The pack/unpack helpers are the compressed-tensors package's own.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from dsquant.errors import ConfigError
from dsquant.formats.base import CONFIG_JSON
from dsquant.formats.int_grid import unpack_last_dim

INT4_TENSORS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
FP8_TENSORS = ("weight", "weight_scale")
FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
               "block_structure": [128, 128], "dynamic": False, "observer": "minmax"}
FP8_INPUTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 128,
              "dynamic": True, "observer": None}


def int4_args(group: int) -> dict:
    """The `weights` args dsquant writes for asymmetric INT4 with group size `group`."""
    return {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": group,
            "dynamic": False, "observer": "minmax"}


def pack_quantized_tensors(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """Grid codes q [N, K] (0..15), scales / zeros [N, K/G] -> {tensor suffix: tensor}, pack-quantized."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = q.shape
    return {"weight_packed": pack_to_int32((q.to(torch.int8) - 8).cpu(), 4),
            "weight_scale": scales.contiguous(),
            "weight_zero_point": pack_to_int32((zeros - 8).to(torch.int8).cpu(), 4, packed_dim=0),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64)}


def dequantize_pack_quantized(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                              shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """weight_packed [N, K/8], weight_scale [N, K/G], weight_zero_point [N/8, K/G] (None: symmetric)
    -> dense [N, K] in `dtype`."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    n, k = shape
    scale = scale.to(torch.float32)
    q = unpack_from_int32(packed, 4, torch.Size([n, k])).to(torch.float32)  # signed codes
    if zero_point is not None:
        zp = unpack_from_int32(zero_point, 4, torch.Size([n, scale.shape[1]]), packed_dim=0).to(torch.float32)
    else:
        zp = torch.zeros_like(scale)
    g = k // scale.shape[1]
    w = (q.reshape(n, -1, g) - zp[..., None]) * scale[..., None]
    return w.reshape(n, k).to(dtype)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] -> unsigned codes int32 [R, C] (element i of each 8 in bits 4i..4i+3)."""
    return unpack_last_dim(packed, range(8))


@dataclass(frozen=True)
class CTInt4Scheme:
    """A pack-quantized group's weights: 4-bit, group (or channel: group_size 0) strategy."""

    group_size: int  # 0: channel (one group spanning K)
    symmetric: bool
    g_idx: bool = False  # actorder "group": weight_g_idx [K] int32 holds each input channel's group
    marker: ClassVar[str] = "weight_packed"  # the tensor that tells a module is stored so


@dataclass(frozen=True)
class CTFp8Scheme:
    """A float-quantized group's weights: FP8 e4m3 with block, channel or tensor scales."""

    strategy: str  # "block" | "channel" | "tensor"
    dynamic_activations: bool  # W8A8: inputs quantized per token and 128 channels
    marker: ClassVar[str] = "weight_scale"


def matches(name: str, target: str) -> bool:
    """A target names the module by "re:<regex>", by its full name or by a suffix of it."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target or name.endswith("." + target)


@dataclass(frozen=True)
class CTGroup:
    """One config group: the modules it targets and its QuantizationArgs, as written."""

    targets: tuple[str, ...]
    weights: dict  # num_bits, type, symmetric, strategy, group_size / block_structure, ...
    input_activations: dict | None = None
    format: str | None = None
    output_activations: dict | None = None

    @classmethod
    def from_dict(cls, d: dict) -> CTGroup:
        return cls(tuple(d.get("targets") or ()), d.get("weights") or {}, d.get("input_activations"),
                   d.get("format"), d.get("output_activations"))

    @classmethod
    def pack_quantized(cls, targets: list[str], group: int) -> CTGroup:
        return cls(tuple(targets), int4_args(group), None, "pack-quantized")

    @classmethod
    def fp8_block(cls, targets: list[str]) -> CTGroup:
        return cls(tuple(targets), FP8_WEIGHTS, FP8_INPUTS, "float-quantized")

    def to_dict(self) -> dict:
        return {"targets": list(self.targets), "output_activations": self.output_activations,
                "weights": self.weights, "input_activations": self.input_activations, "format": self.format}

    def targets_module(self, prefix: str) -> bool:
        hit = any(matches(prefix, t) for t in self.targets if t != "Linear")
        return hit or ("Linear" in self.targets and prefix != "lm_head")

    def scheme(self, top_format: str | None = None) -> CTInt4Scheme | CTFp8Scheme:
        """The group's weights, validated (`top_format`: the config's, where the group names none).

        FP8 groups with dynamic float-8 `input_activations` run W8A8 (activations quantized per
        token and 128 channels, whatever per-token strategy the config names); without, weight-only.
        """
        weights, fmt = self.weights, self.format or top_format
        kind, bits = weights.get("type", "int"), weights.get("num_bits")
        strategy = weights.get("strategy", "group")
        if kind == "float" and bits == 8:
            if strategy == "block":
                block = (weights.get("block_structure") or [128, 128])
                if list(block) != [128, 128]:
                    raise ConfigError(f"compressed-tensors FP8 block_structure {block} is not supported "
                                      "(expected [128, 128])")
            elif strategy not in ("channel", "tensor"):
                raise ConfigError(f"compressed-tensors FP8 strategy {strategy!r} is not supported")
            act = self.input_activations or {}
            dynamic = act.get("type") == "float" and act.get("num_bits") == 8 and bool(act.get("dynamic", True))
            return CTFp8Scheme(strategy, dynamic)
        if kind == "int" and bits == 4:
            if fmt not in (None, "pack-quantized", "mixed-precision"):
                raise ConfigError(f"compressed-tensors int4 format {fmt!r} is not supported "
                                  "(expected pack-quantized)")
            if strategy not in ("group", "channel"):
                raise ConfigError(f"compressed-tensors int4 strategy {strategy!r} is not supported")
            # "weight" (alias "static") orders GPTQ's columns during calibration and stores nothing extra;
            # "group" (alias "dynamic") stores weight_g_idx: the groups are sets of channels scattered over K
            actorder = weights.get("actorder")
            if actorder not in (None, False, "weight", "static", "group", "dynamic"):
                raise ConfigError(f"compressed-tensors int4 actorder {actorder!r} is not supported "
                                  "(expected none, 'weight', 'static', 'group' or 'dynamic')")
            group = weights.get("group_size") or 0 if strategy == "group" else 0
            g_idx = actorder in ("group", "dynamic")
            if g_idx and not group:
                raise ConfigError(f"compressed-tensors int4 actorder {actorder!r} needs the group strategy, "
                                  f"got {strategy!r}")
            return CTInt4Scheme(group, bool(weights.get("symmetric", True)), g_idx)
        raise ConfigError(f"compressed-tensors weights {kind} {bits}-bit are not supported "
                          "(expected int 4-bit or float 8-bit)")


@dataclass(frozen=True)
class CompressedTensorsConfig:
    """A compressed-tensors quantization_config: its groups in order, and the modules it ignores."""

    groups: tuple[tuple[str, CTGroup], ...]
    ignore: tuple[str, ...] = ()
    format: str | None = None  # pack-quantized | float-quantized | mixed-precision
    quantization_status: str = "compressed"
    kv_cache_scheme: dict | None = None
    source: str = CONFIG_JSON

    method: ClassVar[str] = "compressed-tensors"

    @classmethod
    def from_dict(cls, q: dict, source: str = CONFIG_JSON) -> CompressedTensorsConfig:
        groups = tuple((name, CTGroup.from_dict(g)) for name, g in (q.get("config_groups") or {}).items())
        return cls(groups, tuple(q.get("ignore") or ()), q.get("format"),
                   q.get("quantization_status", "compressed"), q.get("kv_cache_scheme"), source)

    @classmethod
    def from_groups(cls, groups: list[CTGroup], ignore: list[str]) -> CompressedTensorsConfig:
        """dsquant's config: groups named group_0, group_1, ...; the format theirs when all agree."""
        kinds = {g.format for g in groups}
        top = kinds.pop() if len(kinds) == 1 else "mixed-precision"
        return cls(tuple((f"group_{i}", g) for i, g in enumerate(groups)), tuple(ignore), top)

    def to_dict(self) -> dict:
        return {"quant_method": "compressed-tensors", "format": self.format,
                "quantization_status": self.quantization_status,
                "config_groups": {name: g.to_dict() for name, g in self.groups}, "ignore": list(self.ignore),
                "kv_cache_scheme": self.kv_cache_scheme}

    def scheme_for(self, prefix: str) -> CTInt4Scheme | CTFp8Scheme | None:
        """The scheme of the first group targeting module `prefix`; None where it stays dense."""
        if any(matches(prefix, t) for t in self.ignore):
            return None
        for _, group in self.groups:
            if group.targets_module(prefix):
                return group.scheme(self.format)
        return None
