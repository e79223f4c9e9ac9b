"""AutoAWQ "gemm" (W4A16, asymmetric): tensor layout, pack/unpack, and its quantization_config.

Tensors per Linear (out N, in K, group G):
  qweight int32 [K, N/8]    8 nibbles per int32 along N; nibble i (bits 4i..4i+3) of packed
                            column c holds output column 8c + AWQ_ORDER[i],
                            AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
  qzeros  int32 [K/G, N/8]  zero points, packed the same way
  scales  fp16/bf16 [K/G, N]
  W^T[k, n] = (q - z) * s.
quantization_config: {quant_method: awq, bits: 4, group_size, zero_point: true, version: gemm,
modules_to_not_convert}; AutoAWQ's own quant_config.json spells {w_bit, q_group_size,
zero_point, version: "GEMM"} (read through quantization_config.normalize).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dsquant.errors import ConfigError
from dsquant.formats.base import CONFIG_JSON, describe_int4, int4_bits_and_group, names, names_entries, not_converted
from dsquant.formats.int_grid import group_index, pack_last_dim, unpack_last_dim

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# column j inside a pack of 8 sits in nibble AWQ_NIBBLE_OF_COLUMN[j]
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
TENSORS = ("qweight", "qzeros", "scales")


def expected_shapes(group: int, n: int, k: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape for a Linear of out_features N, in_features K, group size G (> 0)."""
    return {"qweight": (k, n // 8), "qzeros": (k // group, n // 8), "scales": (k // group, n)}


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """q [R, N] codes 0..15 (R = K for qweight, K/G for qzeros) -> int32 [R, N/8] in AWQ order."""
    return pack_last_dim(q, AWQ_NIBBLE_OF_COLUMN)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] in AWQ order -> int32 [R, N] codes 0..15."""
    return unpack_last_dim(packed, AWQ_NIBBLE_OF_COLUMN)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """AWQ gemm tensors -> dense weight [N, K] in `dtype`."""
    q = unpack_awq(qweight)  # [K, N]
    z = unpack_awq(qzeros)  # [K/G, N]
    k = q.shape[0]
    g = group_index(k, group_size, q.device)  # [K]
    w_t = (q - z[g]).to(torch.float32) * scales.to(torch.float32)[g]  # [K, N]
    return w_t.t().contiguous().to(dtype)


def to_awq_tensors(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype=torch.float16):
    """Grid codes in [N, K] / [N, K/G] layout -> AWQ gemm (qweight, qzeros, scales)."""
    return pack_awq(q.t()), pack_awq(zeros.t()), scales.t().contiguous().to(dtype)


@dataclass(frozen=True)
class AwqConfig:
    """An AutoAWQ gemm quantization_config, validated; `source` is the file it came from."""

    group_size: int = 128  # -1: one group spanning K (per channel)
    # substrings of module names kept dense (None: the config does not state it; (): null); vLLM's
    # ignored_layers is the same
    modules_to_not_convert: tuple[str, ...] | None = None
    ignored_layers: tuple[str, ...] | None = None
    source: str = CONFIG_JSON

    method: ClassVar[str] = "awq"
    bits: ClassVar[int] = 4
    zero_point: ClassVar[bool] = True
    desc_act: ClassVar[bool] = False
    version: ClassVar[str] = "gemm"
    v2: ClassVar[bool] = False
    marker: ClassVar[str] = "qweight"  # the tensor that tells a module is stored in this format

    @classmethod
    def from_dict(cls, q: dict, source: str = CONFIG_JSON) -> AwqConfig:
        group = int4_bits_and_group(q, "awq", source)
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"{source}: AWQ version {q.get('version')!r} is not supported (expected gemm)")
        if not bool(q.get("zero_point", True)):
            raise ConfigError(f"{source}: AWQ zero_point false is not supported (expected true: "
                              "AutoAWQ gemm stores qzeros)")
        return cls(group, names(q, "modules_to_not_convert"), names(q, "ignored_layers"), source)

    def to_dict(self) -> dict:
        return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                "version": "gemm", **names_entries(self.modules_to_not_convert, self.ignored_layers)}

    def scheme_for(self, prefix: str) -> AwqConfig | None:
        """This config for module `prefix`, or None where it stays dense (lm_head, not converted)."""
        if prefix == "lm_head" or not_converted(prefix, self.modules_to_not_convert, self.ignored_layers):
            return None
        return self

    def describe(self) -> str:
        return describe_int4(self.method, self.bits, self.group_size, True, "gemm", False, self.source)
