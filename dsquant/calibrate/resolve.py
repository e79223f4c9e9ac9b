"""Each decoder-layer Linear's scheme, resolved once, up front, from the recipe and the model's shapes.

A recipe names a group size; real models have in_features (K) it does not divide (DeepSeek-V2-Lite's
dense down_proj K = 10944, hidden sizes such as 576). The recipe's `on_indivisible` says what an
INT scheme does there:
  fallback (default)  the largest of 64 and 32 below the recipe's group size that divides K, else BF16
  keep                BF16
  error               stop before any work, naming the module (the behaviour before this key existed)
INT4 packing also needs out_features (N) to be a multiple of 8; under fallback and keep such a
Linear stays BF16. Every module that does not get its recipe scheme is listed in `fallbacks`,
which the manifest and the quantize summary print.

Formats with one group size for the whole model (AutoAWQ, GPTQ: `single_group`) keep the
modules whose resolved group differs in BF16 instead; `--format auto` writes compressed-tensors,
which has a config group per group size, when the resolved groups differ (export_format.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import nn

from dsquant.calibrate.recipe import Recipe, SchemeSpec
from dsquant.errors import ConfigError

FALLBACK_GROUPS = (64, 32)  # tried in order, below the recipe's group size
BF16 = SchemeSpec("bf16")


def describe(spec: SchemeSpec) -> str:
    """'awq g128', 'fp8_block', 'bf16'."""
    return f"{spec.scheme} g{spec.group_size}" if spec.is_int else spec.scheme


@dataclass(frozen=True)
class Fallback:
    """A module that does not get the recipe's scheme: what it asked for, what it gets, and why."""

    wanted: SchemeSpec
    got: SchemeSpec
    reason: str

    def to_dict(self) -> dict:
        return {"from": describe(self.wanted), "to": describe(self.got), "reason": self.reason}


@dataclass
class ResolvedSchemes:
    specs: dict[str, SchemeSpec]  # full module name -> the scheme it is quantized with
    fallbacks: dict[str, Fallback] = field(default_factory=dict)  # the modules whose scheme changed

    def int_groups(self) -> set[int]:
        return {s.group_size for s in self.specs.values() if s.is_int}

    def single_group(self, fmt: str) -> "ResolvedSchemes":
        """For a one-group-size format (awq, gptq): modules whose resolved group is not the model's
        group stay BF16. The model's group is that of the modules that kept their recipe scheme
        (else the largest resolved one)."""
        own = {s.group_size for n, s in self.specs.items() if s.is_int and n not in self.fallbacks}
        if len(self.int_groups()) <= 1:
            return self
        if len(own) > 1:
            raise ConfigError(f"--format {fmt}: holds one group size, the recipe asks for {sorted(own)}")
        group = max(own or self.int_groups())
        specs, fallbacks = dict(self.specs), dict(self.fallbacks)
        for name, spec in self.specs.items():
            if spec.is_int and spec.group_size != group:
                before = fallbacks[name]
                specs[name] = BF16
                fallbacks[name] = replace(before, got=BF16, reason=f"{before.reason}; --format {fmt} holds one "
                                          f"group size ({group}), so not {describe(spec)}")
        return ResolvedSchemes(specs, fallbacks)


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Decoder-layer Linears of `model` (meta tensors suffice): full name -> (out N, in K)."""
    return {name: (mod.out_features, mod.in_features) for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and name.startswith("model.layers.")}


def _resolve_one(name: str, n: int, k: int, spec: SchemeSpec, recipe: Recipe) -> tuple[SchemeSpec, str | None]:
    """-> (the scheme `name` gets, why it differs from `spec`, or None)."""
    if not spec.is_int:
        return spec, None
    if n % 8:
        problem = f"out_features {n} is not a multiple of 8 (INT4 packs 8 rows per int32)"
        options = []
    elif k % spec.group_size:
        problem = f"group_size {spec.group_size} does not divide in_features {k}"
        options = [g for g in FALLBACK_GROUPS if g < spec.group_size and k % g == 0]
    else:
        return spec, None
    if recipe.on_indivisible == "error":
        where = recipe.source or f"recipe {recipe.name}"
        raise ConfigError(f"{where}: {problem} of {name} (on_indivisible: error; 'fallback' would take the "
                          f"largest smaller group of {' or '.join(map(str, FALLBACK_GROUPS))} that fits, else BF16; "
                          "'keep' leaves it BF16)")
    if recipe.on_indivisible == "fallback" and options:
        return replace(spec, group_size=options[0]), problem
    return BF16, problem


def resolve_schemes(model_or_shapes, recipe: Recipe) -> ResolvedSchemes:
    """Every decoder-layer Linear's scheme: the recipe's, or its fallback (module docstring).

    model_or_shapes: a model (its Linears' shapes are read, no weights needed) or
    {full name: (out_features, in_features)}."""
    shapes = model_or_shapes if isinstance(model_or_shapes, dict) else linear_shapes(model_or_shapes)
    specs, fallbacks = {}, {}
    for name, (n, k) in shapes.items():
        wanted = recipe.scheme_for(name)
        got, reason = _resolve_one(name, n, k, wanted, recipe)
        specs[name] = got
        if reason is not None:
            fallbacks[name] = Fallback(wanted, got, reason)
    return ResolvedSchemes(specs, fallbacks)
