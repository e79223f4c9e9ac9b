"""Which artifact format a recipe exports to (`dsquant quantize --format`).

Native formats: awq for AWQ / RTN INT4 with one group size, gptq for GPTQ with one group size,
fp8 for FP8 block alone; anything else (mixed schemes, or INT modules that fell back to other
group sizes, calibrate/resolve.py) is compressed-tensors. The writers are in export/codecs.py.
"""
from __future__ import annotations

from dsquant.calibrate.recipe import Recipe
from dsquant.errors import ConfigError
from dsquant.export.codecs import FORMATS


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
