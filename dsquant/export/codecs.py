"""Export codecs: a quantized Linear's tensors and the quantization_config, per artifact format.

| format             | tensors per Linear (layouts: dsquant/formats/)             | loaded by            |
| ------------------ | ---------------------------------------------------------- | -------------------- |
| awq (AutoAWQ gemm) | qweight [K, N/8], qzeros [K/G, N/8], scales fp16 [K/G, N]   | vLLM, SGLang, HF     |
| gptq (v1)          | qweight [K/8, N], qzeros [K/G, N/8], scales, g_idx [K]      | vLLM, SGLang, HF     |
| fp8 (DeepSeek-V3)  | weight e4m3 [N, K], weight_scale_inv fp32 [N/128, K/128]    | vLLM, SGLang, HF     |
| compressed-tensors | pack-quantized: weight_packed [N, K/8], weight_scale [N, K/G], weight_zero_point [N/8, K/G], weight_shape; float-quantized: weight e4m3, weight_scale [N/128, K/128] | vLLM, SGLang, llm-compressor |

The config dicts are the formats' dataclasses' `to_dict` (AwqConfig, GptqConfig, Fp8BlockConfig,
CompressedTensorsConfig); this module decides their contents. Which format a recipe writes is
calibrate/export_format.py's choice. Group sizes: AutoAWQ and GPTQ hold one group size for the
whole model; compressed-tensors has one config group per ("int4", group size) and one for FP8.
Modules that fell back from a shape under `--format awq|gptq` stay BF16 and are listed by their
full name in `modules_to_not_convert` (vLLM, SGLang and transformers skip a module when an entry
is a substring of its full name, so a stripped `mlp.down_proj` would skip that type in every
layer). Recipe-kept modules are listed without their `model.layers.N.` prefix where no quantized
module shares that name.
"""
from __future__ import annotations

import re
from typing import Protocol

import torch

from dsquant.errors import ConfigError
from dsquant.formats import AwqConfig, CompressedTensorsConfig, Fp8BlockConfig, GptqConfig
from dsquant.formats.awq_gemm import pack_awq
from dsquant.formats.compressed_tensors import CTGroup, pack_quantized_tensors
from dsquant.formats.gptq import pack_gptq_qweight, pack_gptq_qzeros
from dsquant.formats.int_grid import group_index

EXPORT_DTYPE = torch.bfloat16
FORMATS = ("auto", "awq", "gptq", "fp8", "compressed-tensors")


class SchemeLike(Protocol):
    """A Linear's scheme as export reads it (calibrate's SchemeSpec is one)."""

    scheme: str  # "bf16" | "fp8_block" | an INT scheme (awq, gptq, rtn)
    group_size: int


class QuantizedLinear(Protocol):
    """What export reads of one quantized Linear (calibrate's QuantizedWeight is one): int schemes
    fill q [N, K] / scales [N, K/G] / zeros [N, K/G] (+ g_idx [K] for GPTQ), fp8_block fills
    fp8 [N, K] / scale_inv [ceil(N/128), ceil(K/128)], bf16 keeps `dequantized` [N, K]."""

    spec: SchemeLike
    dequantized: torch.Tensor | None
    q: torch.Tensor | None
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    fp8: torch.Tensor | None
    scale_inv: torch.Tensor | None


class GptqSettings(Protocol):
    """The GPTQ options the gptq quantization_config states (calibrate's GPTQOptions is one)."""

    act_order: bool
    static_groups: bool
    sym: bool
    damp_percent: float


def scale_dtype_for(fmt: str) -> torch.dtype:
    """AutoAWQ and GPTQ store fp16 scales; compressed-tensors stores the model's bf16."""
    return torch.bfloat16 if fmt == "compressed-tensors" else torch.float16


def linear_tensors(name: str, qw: QuantizedLinear, fmt: str) -> dict[str, torch.Tensor]:
    """Tensors of one Linear `name` (without bias) in export format `fmt`."""
    s = qw.spec
    if s.scheme == "bf16":
        return {f"{name}.weight": qw.dequantized.to(EXPORT_DTYPE)}
    if s.scheme == "fp8_block":
        key = "weight_scale" if fmt == "compressed-tensors" else "weight_scale_inv"
        return {f"{name}.weight": qw.fp8, f"{name}.{key}": qw.scale_inv.to(torch.float32)}
    n, k = qw.q.shape
    if n % 8:
        raise ConfigError(f"{name}: out_features {n} is not a multiple of 8; INT4 packing needs it")
    if fmt == "awq":
        return {f"{name}.qweight": pack_awq(qw.q.t()), f"{name}.qzeros": pack_awq(qw.zeros.t()),
                f"{name}.scales": qw.scales.t().contiguous()}
    if fmt == "gptq":
        g_idx = qw.g_idx if qw.g_idx is not None else group_index(k, s.group_size).to(torch.int32)
        return {f"{name}.qweight": pack_gptq_qweight(qw.q.t()),
                f"{name}.qzeros": pack_gptq_qzeros(qw.zeros.t()),
                f"{name}.scales": qw.scales.t().contiguous(), f"{name}.g_idx": g_idx}
    # compressed-tensors pack-quantized: signed int4 codes q - 8 and zero points z - 8
    return {f"{name}.{suffix}": t for suffix, t in pack_quantized_tensors(qw.q, qw.scales, qw.zeros).items()}


def type_regex(name: str) -> str:
    """'model.layers.3.mlp.experts.7.up_proj' -> 're:^model\\.layers\\.\\d+\\.mlp...up_proj$'."""
    parts = re.split(r"(?<=\.)\d+(?=\.)", name)
    return "re:^" + r"\d+".join(re.escape(p) for p in parts) + "$"


def _targets(by_kind: dict[tuple, list[str]]) -> dict[tuple, list[str]]:
    """Per group, regexes per module type; exact names for a type split across groups."""
    owners: dict[str, set] = {}
    for kind, names in by_kind.items():
        for n in names:
            owners.setdefault(type_regex(n), set()).add(kind)
    out = {}
    for kind, names in by_kind.items():
        regexes = {type_regex(n) for n in names if len(owners[type_regex(n)]) == 1}
        exact = {f"re:^{re.escape(n)}$" for n in names if len(owners[type_regex(n)]) > 1}
        out[kind] = sorted(regexes | exact)
    return out


def not_convert_names(kept: list[str], quantized: list[str], full: set[str] | frozenset = frozenset()) \
        -> list[str]:
    """modules_to_not_convert: each kept module without its `model.layers.N.` prefix where that
    stripped name is in no quantized module's name (readers match substrings) and the module is not
    in `full` (shape fallbacks); else its full name."""
    strip = lambda n: re.sub(r"^model\.layers\.\d+\.", "", n)  # noqa: E731
    quantized_short = {strip(n) for n in quantized}
    safe: dict[str, bool] = {}
    out = set()
    for n in kept:
        short = strip(n)
        if short not in safe:
            safe[short] = not any(short in q for q in quantized_short)
        out.add(short if safe[short] and n not in full else n)
    return sorted(out)


def quantization_config(fmt: str, schemes: dict[str, tuple[str, int]], kept: list[str],
                        fallbacks: set[str] | frozenset = frozenset(), *, default_group: int,
                        gptq: GptqSettings) -> dict:
    """config.json's quantization_config; `schemes` maps quantized module -> (scheme, group);
    `kept`: the BF16 decoder-layer Linears, of which `fallbacks` fell back from a shape (full names);
    `default_group`: the recipe's group size (stated when no module is INT); `gptq`: the GPTQ
    options the gptq format records (read for fmt gptq only)."""
    groups = sorted({g for s, g in schemes.values() if s != "fp8_block"}) or [default_group]
    if fmt in ("awq", "gptq") and len(groups) > 1:
        raise ConfigError(f"--format {fmt}: holds one group size, the modules have {groups}")
    not_convert = tuple(not_convert_names(kept, list(schemes), fallbacks))  # () is written as null
    if fmt == "awq":
        return AwqConfig(groups[0], not_convert).to_dict()
    if fmt == "gptq":
        return GptqConfig(groups[0], sym=gptq.sym,
                          desc_act=gptq.act_order and not gptq.static_groups,  # static groups: g_idx is the identity
                          modules_to_not_convert=not_convert, damp_percent=gptq.damp_percent,
                          static_groups=gptq.static_groups).to_dict()
    if fmt == "fp8":
        return Fp8BlockConfig(not_convert).to_dict()
    by_kind: dict[tuple, list[str]] = {}
    for name, (scheme, group) in schemes.items():
        by_kind.setdefault(("fp8", 0) if scheme == "fp8_block" else ("int4", group), []).append(name)
    targets = _targets(by_kind)
    ct_groups = [CTGroup.fp8_block(targets[kind]) if kind[0] == "fp8"
                 else CTGroup.pack_quantized(targets[kind], kind[1]) for kind in sorted(by_kind)]
    return CompressedTensorsConfig.from_groups(ct_groups, sorted(set(kept) | {"lm_head"})).to_dict()
