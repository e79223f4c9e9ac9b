"""Export codecs: a quantized Linear's tensors and the quantization_config, per artifact format.

| format             | tensors per Linear                                         | loaded by            |
| ------------------ | ---------------------------------------------------------- | -------------------- |
| awq (AutoAWQ gemm) | qweight [K, N/8], qzeros [K/G, N/8], scales fp16 [K/G, N]   | vLLM, SGLang, HF     |
| gptq (v1)          | qweight [K/8, N], qzeros [K/G, N/8], scales, g_idx [K]      | vLLM, SGLang, HF     |
| fp8 (DeepSeek-V3)  | weight e4m3 [N, K], weight_scale_inv fp32 [N/128, K/128]    | vLLM, SGLang, HF     |
| compressed-tensors | pack-quantized: weight_packed [N, K/8], weight_scale [N, K/G], weight_zero_point [N/8, K/G], weight_shape; float-quantized: weight e4m3, weight_scale [N/128, K/128] | vLLM, SGLang, llm-compressor |

Group sizes: AutoAWQ and GPTQ hold one group size for the whole model. When a recipe's group
size does not divide some Linears' in_features and they fall back to group 64 or 32
(calibrate/resolve.py), `--format auto` writes compressed-tensors, one config group per
("int4", group size); an explicit `--format awq|gptq` keeps those modules BF16 instead and lists
each by its full name in `modules_to_not_convert` (vLLM, SGLang and transformers skip a module
when an entry is a substring of its full name, so a stripped `mlp.down_proj` would skip that
type in every layer). Recipe-kept modules are listed without their `model.layers.N.` prefix
where no quantized module shares that name.
"""
from __future__ import annotations

import re

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from dsquant import formats
from dsquant.calibrate.quantizers import QuantizedWeight
from dsquant.calibrate.recipe import Recipe
from dsquant.errors import ConfigError

EXPORT_DTYPE = torch.bfloat16


def export_format(recipe: Recipe, groups: set[int] | None = None) -> str:
    """The recipe's native format; `groups`: the INT group sizes its modules resolved to (default:
    the recipe's own)."""
    used = recipe.schemes_used()
    if groups is None:
        groups = {recipe.default.group_size} | {s.group_size for _, s in recipe.rules if s.is_int}
    groups = groups or {recipe.default.group_size}
    if used <= {"awq", "rtn"} and len(groups) == 1:
        return "awq"
    if used == {"gptq"} and len(groups) == 1:
        return "gptq"
    if used == {"fp8_block"}:
        return "fp8"
    return "compressed-tensors"


FORMATS = ("auto", "awq", "gptq", "fp8", "compressed-tensors")


def choose_format(recipe: Recipe, requested: str | None, groups: set[int] | None = None) -> str:
    """The export format for `--format requested`: auto (or None) is the native format of the
    recipe with its resolved group sizes `groups` (export_format); compressed-tensors takes any
    recipe (pack-quantized INT4, float-quantized FP8); awq / gptq / fp8 only where they are the
    recipe's own format (modules resolved to another group are then kept BF16:
    ResolvedSchemes.single_group). Act-order GPTQ needs g_idx, which only the gptq format
    carries here: such a recipe stays gptq (shape fallbacks BF16) and never goes compressed-tensors."""
    own, native = export_format(recipe), export_format(recipe, groups)
    # act-order with static groups keeps the groups in column order: no g_idx to store
    act_order = "gptq" in recipe.schemes_used() and recipe.gptq.act_order and not recipe.gptq.static_groups
    if act_order and native == "compressed-tensors" and own == "gptq":
        native = "gptq"
    if act_order and (requested == "compressed-tensors" or (requested in (None, "auto") and native != "gptq")):
        raise ConfigError(f"--format {requested or 'auto'}: recipe {recipe.name} uses act-order GPTQ "
                          "(gptq.act_order: true), whose g_idx only the gptq format stores; use GPTQ alone "
                          "with --format gptq, or act_order: false")
    if requested in (None, "auto"):
        return native
    if requested in (native, own, "compressed-tensors"):
        return requested
    if requested not in FORMATS:
        raise ConfigError(f"--format {requested}: expected one of {', '.join(FORMATS)}")
    valid = ", ".join(dict.fromkeys(["auto", own, native, "compressed-tensors"]))
    raise ConfigError(f"--format {requested}: not available for recipe {recipe.name} "
                      f"({', '.join(sorted(recipe.schemes_used()))}); expected one of {valid}")


def scale_dtype_for(fmt: str) -> torch.dtype:
    """AutoAWQ and GPTQ store fp16 scales; compressed-tensors stores the model's bf16."""
    return torch.bfloat16 if fmt == "compressed-tensors" else torch.float16


def linear_tensors(name: str, qw: QuantizedWeight, fmt: str) -> dict[str, torch.Tensor]:
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
        return {f"{name}.qweight": formats.pack_awq(qw.q.t()), f"{name}.qzeros": formats.pack_awq(qw.zeros.t()),
                f"{name}.scales": qw.scales.t().contiguous()}
    if fmt == "gptq":
        g_idx = qw.g_idx if qw.g_idx is not None else formats.group_index(k, s.group_size).to(torch.int32)
        return {f"{name}.qweight": formats.pack_gptq_qweight(qw.q.t()),
                f"{name}.qzeros": formats.pack_gptq_qzeros(qw.zeros.t()),
                f"{name}.scales": qw.scales.t().contiguous(), f"{name}.g_idx": g_idx}
    # compressed-tensors pack-quantized: signed int4 codes q - 8 and zero points z - 8
    return {f"{name}.weight_packed": pack_to_int32((qw.q.to(torch.int8) - 8).cpu(), 4),
            f"{name}.weight_scale": qw.scales.contiguous(),
            f"{name}.weight_zero_point": pack_to_int32((qw.zeros - 8).to(torch.int8).cpu(), 4, packed_dim=0),
            f"{name}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}


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


def _int_args(recipe: Recipe, group: int) -> dict:
    return {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": group,
            "dynamic": False, "observer": "minmax"}


FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
               "block_structure": [128, 128], "dynamic": False, "observer": "minmax"}
FP8_INPUTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 128,
              "dynamic": True, "observer": None}


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


def quantization_config(fmt: str, recipe: Recipe, schemes: dict[str, tuple[str, int]], kept: list[str],
                        fallbacks: set[str] | frozenset = frozenset()) -> dict:
    """config.json's quantization_config; `schemes` maps quantized module -> (scheme, group);
    `kept`: the BF16 decoder-layer Linears, of which `fallbacks` fell back from a shape (full names)."""
    groups = sorted({g for s, g in schemes.values() if s != "fp8_block"}) or [recipe.default.group_size]
    if fmt in ("awq", "gptq") and len(groups) > 1:
        raise ConfigError(f"--format {fmt}: holds one group size, the modules have {groups}")
    not_convert = not_convert_names(kept, list(schemes), fallbacks) or None
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": groups[0], "zero_point": True,
                "version": "gemm", "modules_to_not_convert": not_convert}
    if fmt == "gptq":
        g = recipe.gptq
        return {"quant_method": "gptq", "bits": 4, "group_size": groups[0],
                "desc_act": g.act_order and not g.static_groups,  # static groups: g_idx is the identity
                "sym": g.sym, "damp_percent": g.damp_percent, "true_sequential": False,
                "static_groups": g.static_groups, "checkpoint_format": "gptq", "modules_to_not_convert": not_convert}
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": not_convert}
    config_groups = {}
    by_kind: dict[tuple, list[str]] = {}
    for name, (scheme, group) in schemes.items():
        by_kind.setdefault(("fp8", 0) if scheme == "fp8_block" else ("int4", group), []).append(name)
    targets = _targets(by_kind)
    for i, (kind, names) in enumerate(sorted(by_kind.items())):
        if kind[0] == "fp8":
            body = {"weights": FP8_WEIGHTS, "input_activations": FP8_INPUTS, "format": "float-quantized"}
        else:
            body = {"weights": _int_args(recipe, kind[1]), "input_activations": None, "format": "pack-quantized"}
        config_groups[f"group_{i}"] = {"targets": targets[kind], "output_activations": None, **body}
    group_formats = {g["format"] for g in config_groups.values()}  # one: the recipe is uniform
    top_format = group_formats.pop() if len(group_formats) == 1 else "mixed-precision"
    return {"quant_method": "compressed-tensors", "format": top_format, "quantization_status": "compressed",
            "config_groups": config_groups, "ignore": sorted(set(kept) | {"lm_head"}), "kv_cache_scheme": None}
