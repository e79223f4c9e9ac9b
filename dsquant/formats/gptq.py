"""GPTQ v1 / v2 (W4A16): tensor layout, pack/unpack, and its quantization_config.

Tensors per Linear (out N, in K, group G):
  qweight int32 [K/8, N]    packed along K: nibble i of row r is k = 8r + i
  qzeros  int32 [K/G, N/8]  packed along N in plain order; stored as z - 1 (v1, checkpoint_format
                            "gptq"), or z itself (v2, GPTQModel's checkpoint_format "gptq_v2")
  scales  fp16 [K/G, N]
  g_idx   int32 [K]         group of each input channel (a permutation under act-order, desc_act)
  W^T[k, n] = (q - z[g_idx[k]]) * s[g_idx[k]].
quantization_config: {quant_method: gptq, bits: 4, group_size, desc_act, sym, damp_percent,
true_sequential, static_groups, checkpoint_format, modules_to_not_convert}; AutoGPTQ's
quantize_config.json holds the same keys (read through quantization_config.normalize).
Marlin / BitBLAS / other repacked formats are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from dsquant.errors import ConfigError
from dsquant.formats.base import CONFIG_JSON, describe_int4, int4_bits_and_group, names, names_entries, not_converted
from dsquant.formats.int_grid import group_index, pack_last_dim, unpack_last_dim

TENSORS = ("qweight", "qzeros", "scales", "g_idx")
GPTQ_FORMATS = ("gptq", "gptq_v2")


def is_plain_g_idx(g_idx: torch.Tensor, groups: int) -> bool:
    """Whether g_idx [K] puts the channels in `groups` contiguous runs of K / groups (no act-order)."""
    k = g_idx.numel()
    return torch.equal(g_idx.to(torch.long), torch.arange(k, device=g_idx.device) // (k // groups))


def act_order_perm(g_idx: torch.Tensor, groups: int) -> torch.Tensor | None:
    """The channel order that makes an act-order g_idx [K] plain: perm [K] (int64) with
    g_idx[perm] == arange(K) // G, so packed channel j holds input channel perm[j] and the kernels
    gather x[:, perm]; None when g_idx is already plain. A ValueError when the groups do not each
    hold exactly G = K / groups channels."""
    k = g_idx.numel()
    g = g_idx.to(torch.long)
    plain = torch.arange(k, device=g.device) // (k // groups)
    if torch.equal(g, plain):
        return None
    order = torch.argsort(g, stable=True)  # [K]
    if not torch.equal(g[order], plain):
        raise ValueError(f"g_idx must put exactly group_size={k // groups} input channels in each of {groups} groups")
    return order


def expected_shapes(group: int, n: int, k: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape for a Linear of out_features N, in_features K, group size G (> 0)."""
    ng = k // group
    return {"qweight": (k // 8, n), "qzeros": (ng, n // 8), "scales": (ng, n), "g_idx": (k,)}


def pack_gptq_qweight(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] codes 0..15 -> int32 [K/8, N], packed along K in plain order."""
    k, n = q.shape
    if k % 8:
        raise ValueError(f"GPTQ packing needs K % 8 == 0, got K={k}")
    return pack_last_dim(q.t(), range(8)).t().contiguous()


def unpack_gptq_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] -> int32 [K, N] codes 0..15."""
    return unpack_last_dim(qweight.t(), range(8)).t().contiguous()


def pack_gptq_qzeros(z: torch.Tensor, v2: bool = False) -> torch.Tensor:
    """zero points [K/G, N] -> int32 [K/G, N/8]: v1 stores z - 1 (z in 1..16), v2 z itself (0..15).

    GPTQ v1 cannot store a zero point of 0 (it would wrap to 15 and read back as 16, another
    weight): such grids are refused; clamp z to >= 1 and re-round the codes first (calibrate/gptq.py).
    """
    z = z.to(torch.int32)
    lo, hi = (0, 15) if v2 else (1, 16)
    if z.numel() and (int(z.min()) < lo or int(z.max()) > hi):
        if v2:
            raise ValueError(f"GPTQ v2 stores zero points 0..15, got {int(z.min())}..{int(z.max())}")
        raise ValueError(f"GPTQ v1 stores zero points 1..16 (as z - 1 in 4 bits), got {int(z.min())}.."
                         f"{int(z.max())}: clamp the zero points to >= 1 and re-round the codes")
    return pack_last_dim(z if v2 else (z - 1) & 0xF, range(8))


def unpack_gptq_qzeros(qzeros: torch.Tensor, v2: bool = False) -> torch.Tensor:
    """int32 [K/G, N/8] -> zero points [K/G, N]: the stored value + 1 (v1), or as stored (v2)."""
    return unpack_last_dim(qzeros, range(8)) + (0 if v2 else 1)


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor, dtype: torch.dtype = torch.float32, v2: bool = False) -> torch.Tensor:
    """GPTQ tensors (v1, or v2 with `v2`) -> dense weight [N, K] in `dtype`."""
    q = unpack_gptq_qweight(qweight)  # [K, N]
    z = unpack_gptq_qzeros(qzeros, v2)  # [K/G, N]
    g = g_idx.to(torch.long)
    w_t = (q - z[g]).to(torch.float32) * scales.to(torch.float32)[g]  # [K, N]
    return w_t.t().contiguous().to(dtype)


def to_gptq_tensors(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype=torch.float16, v2: bool = False):
    """Grid codes in [N, K] / [N, K/G] layout -> GPTQ v1 (or v2) (qweight, qzeros, scales, g_idx)."""
    k = q.shape[1]
    g_idx = group_index(k, group_size, q.device).to(torch.int32)
    return (pack_gptq_qweight(q.t()), pack_gptq_qzeros(zeros.t(), v2), scales.t().contiguous().to(dtype),
            g_idx)


@dataclass(frozen=True)
class GptqConfig:
    """A GPTQ quantization_config, validated; `source` is the file it came from. The fields after
    checkpoint_format describe how it was made (written by dsquant, not needed to read it)."""

    group_size: int = 128  # -1: one group spanning K (per channel)
    sym: bool = True
    desc_act: bool = False  # act-order: g_idx is a permutation's groups
    checkpoint_format: str = "gptq"  # "gptq" (v1: qzeros hold z - 1) | "gptq_v2" (z)
    # substrings of module names kept dense (None: the config does not state it; (): null); vLLM's
    # ignored_layers is the same
    modules_to_not_convert: tuple[str, ...] | None = None
    ignored_layers: tuple[str, ...] | None = None
    damp_percent: float = 0.01
    true_sequential: bool = False
    static_groups: bool = False
    source: str = CONFIG_JSON

    method: ClassVar[str] = "gptq"
    bits: ClassVar[int] = 4
    marker: ClassVar[str] = "qweight"  # the tensor that tells a module is stored in this format

    @property
    def zero_point(self) -> bool:
        return not self.sym

    @property
    def version(self) -> str:
        return self.checkpoint_format

    @property
    def v2(self) -> bool:
        return self.checkpoint_format == "gptq_v2"

    @classmethod
    def from_dict(cls, q: dict, source: str = CONFIG_JSON) -> GptqConfig:
        group = int4_bits_and_group(q, "gptq", source)
        if q.get("is_marlin_format"):
            raise ConfigError(f"{source}: is_marlin_format true (Marlin-repacked GPTQ) is not supported; "
                              "expected checkpoint_format gptq or gptq_v2")
        version = str(q.get("checkpoint_format") or "gptq").lower()
        if version not in GPTQ_FORMATS:
            raise ConfigError(f"{source}: GPTQ checkpoint_format {q.get('checkpoint_format')!r} is not supported "
                              f"(expected {' or '.join(GPTQ_FORMATS)})")
        return cls(group, bool(q.get("sym", True)), bool(q.get("desc_act", False)), version,
                   names(q, "modules_to_not_convert"), names(q, "ignored_layers"),
                   q.get("damp_percent", 0.01), bool(q.get("true_sequential", False)),
                   bool(q.get("static_groups", False)), source)

    def to_dict(self) -> dict:
        return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size, "desc_act": self.desc_act,
                "sym": self.sym, "damp_percent": self.damp_percent, "true_sequential": self.true_sequential,
                "static_groups": self.static_groups, "checkpoint_format": self.checkpoint_format,
                **names_entries(self.modules_to_not_convert, self.ignored_layers)}

    def scheme_for(self, prefix: str) -> GptqConfig | None:
        """This config for module `prefix`, or None where it stays dense (lm_head, not converted)."""
        if prefix == "lm_head" or not_converted(prefix, self.modules_to_not_convert, self.ignored_layers):
            return None
        return self

    def describe(self) -> str:
        return describe_int4(self.method, self.bits, self.group_size, self.zero_point, self.version,
                             self.desc_act, self.source)
