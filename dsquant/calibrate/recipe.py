"""Recipes: YAML files mapping module-name patterns to quantization schemes.

```yaml
name: mixed-fp8attn-w4experts
default: {scheme: fp8_block}                 # every decoder-layer Linear not matched below
rules:                                       # first match wins (fnmatch on the full name)
  - {match: "*.mlp.experts.*", scheme: awq, bits: 4, group_size: 128}
keep: [lm_head, "*.embed_tokens", "*.mlp.gate", "*norm"]   # stay BF16
on_indivisible: fallback                     # group_size does not divide a Linear's in_features:
                                             # fallback (group 64, else 32, else BF16) | keep | error
awq: {grid: 20, duo_scaling: true, clip: true, clip_grid: 20, max_shrink: 0.5}
gptq: {damp_percent: 0.01, block_size: 128, act_order: true, static_groups: true, sym: true}
```
A bad recipe fails before any work, naming the file and the offending key.
"""
from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from dsquant.errors import ConfigError

SCHEMES = ("awq", "gptq", "rtn", "fp8_block", "bf16")
INT_SCHEMES = ("awq", "gptq", "rtn")
GROUP_SIZES = (32, 64, 128)
TOP_KEYS = {"name", "description", "default", "rules", "keep", "on_indivisible", "awq", "gptq"}
# what an INT rule does where its group_size does not divide a Linear's in_features (calibrate/resolve.py)
ON_INDIVISIBLE = ("fallback", "keep", "error")


@dataclass(frozen=True)
class SchemeSpec:
    """How one Linear is quantized."""

    scheme: str
    bits: int = 4
    group_size: int = 128

    @property
    def is_int(self) -> bool:
        return self.scheme in INT_SCHEMES


@dataclass(frozen=True)
class AWQOptions:
    grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    # rows of each Linear's input kept for the searches (x_mean, member and expert losses): 16384
    # against 4096 took AWQ g128 ahead of RTN on both bundled models and sets (dsq-tiny-v3 eval_prose
    # 69.61 against 70.13, RTN 69.96; BENCHMARKS.md, 2026-12-02). The clip search subsamples 4096.
    max_tokens: int = 16384
    block_loss: bool = True  # score scales by the decoder layer's output (else the members' outputs)
    inspect_samples: int = 4  # calibration sequences the layer-output loss runs on
    # quantize each scaling group's AWQ / RTN members right after its fold, so later groups' searches
    # score on a layer whose earlier groups are quantized (calibrate/awq_layer.py). SmolLM2-135M AWQ g64
    # keeps 49.2% / 38.4% of RTN's loss (prose / code) against 57.0% / 41.9% without; the bundled
    # models' prose moves within noise (dsq-tiny-v3 70.61 against 70.27 over seeds 0-3, RTN 69.96),
    # their code gains a little (BENCHMARKS.md, issue 20, 2026-12-02)
    sequential: bool = True
    # calibrate each layer on the float layers' outputs (AutoAWQ), not the quantized ones' (pipeline.py);
    # applies to every method of the run. With sequential on SmolLM2: 55.6% / 42.6% of RTN's loss, worse
    float_inputs: bool = False


@dataclass(frozen=True)
class GPTQOptions:
    damp_percent: float = 0.01
    block_size: int = 128
    # Columns in decreasing Hessian diagonal, each group's grid fixed from the weights before GPTQ
    # moves them, groups kept in column order (llm-compressor's "static" act-order; no g_idx to store).
    # On SmolLM2-135M (g64 sym) +19.3% perplexity against +35.6% for in-order columns with grids on
    # the updated weights (BENCHMARKS.md, issue 20).
    act_order: bool = True
    sym: bool = True
    static_groups: bool = True  # False: a group's grid from its updated weights when GPTQ reaches it


@dataclass
class Recipe:
    name: str
    default: SchemeSpec
    rules: list[tuple[str, SchemeSpec]] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)
    awq: AWQOptions = field(default_factory=AWQOptions)
    gptq: GPTQOptions = field(default_factory=GPTQOptions)
    source: str = ""
    on_indivisible: str = "fallback"  # one of ON_INDIVISIBLE

    def scheme_for(self, module: str) -> SchemeSpec:
        """The scheme of a decoder-layer Linear named `module` (full checkpoint name)."""
        if any(fnmatch.fnmatchcase(module, p) for p in self.keep):
            return SchemeSpec("bf16")
        for pattern, spec in self.rules:
            if fnmatch.fnmatchcase(module, pattern):
                return spec
        return self.default

    def schemes_used(self) -> set[str]:
        return {self.default.scheme, *(s.scheme for _, s in self.rules)} - {"bf16"}

    def to_dict(self) -> dict:
        return {"name": self.name, "default": asdict(self.default),
                "rules": [{"match": p, **asdict(s)} for p, s in self.rules],
                "keep": list(self.keep), "on_indivisible": self.on_indivisible,
                "awq": asdict(self.awq), "gptq": asdict(self.gptq)}


def _spec(raw, where: str) -> SchemeSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping like {{scheme: awq, group_size: 128}}")
    unknown = set(raw) - {"scheme", "bits", "group_size", "match"}
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (expected scheme, bits, group_size)")
    scheme = raw.get("scheme")
    if scheme not in SCHEMES:
        raise ConfigError(f"{where}.scheme: {scheme!r} is not a scheme; expected one of {', '.join(SCHEMES)}")
    bits, group = raw.get("bits", 4), raw.get("group_size", 128)
    if scheme in INT_SCHEMES:
        if bits != 4:
            raise ConfigError(f"{where}.bits: {bits!r} is not supported; INT schemes are 4-bit")
        if group not in GROUP_SIZES:
            raise ConfigError(f"{where}.group_size: {group!r}; expected one of {GROUP_SIZES}")
    return SchemeSpec(scheme, bits, group)


def _options(cls, raw, where: str):
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping")
    names = set(cls.__dataclass_fields__)
    unknown = set(raw) - names
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (expected {', '.join(sorted(names))})")
    for key, value in raw.items():
        default = cls.__dataclass_fields__[key].default
        ok = isinstance(value, bool) if isinstance(default, bool) else (
            not isinstance(value, bool) and isinstance(value, (int, float) if isinstance(default, float) else int))
        if not ok:
            raise ConfigError(f"{where}.{key}: expected a {type(default).__name__}, found {value!r}")
    opts = cls(**raw)
    return opts


def parse_recipe(raw: dict, where: str) -> Recipe:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a YAML mapping at the top level")
    unknown = set(raw) - TOP_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} (expected {', '.join(sorted(TOP_KEYS))})")
    if "default" not in raw:
        raise ConfigError(f"{where}: key 'default' is missing (the scheme for unmatched Linears)")
    rules = []
    for i, rule in enumerate(raw.get("rules") or []):
        if not isinstance(rule, dict) or not isinstance(rule.get("match"), str):
            raise ConfigError(f"{where}: rules[{i}].match must be a module-name pattern string")
        rules.append((rule["match"], _spec(rule, f"{where}: rules[{i}]")))
    keep = raw.get("keep") or []
    if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep):
        raise ConfigError(f"{where}: keep must be a list of module-name patterns")
    on_indivisible = raw.get("on_indivisible", "fallback")
    if on_indivisible not in ON_INDIVISIBLE:
        raise ConfigError(f"{where}: on_indivisible: {on_indivisible!r}; expected one of "
                          f"{', '.join(ON_INDIVISIBLE)} (what an INT scheme does where its group_size "
                          "does not divide a Linear's in_features)")
    recipe = Recipe(name=str(raw.get("name") or Path(where).stem), default=_spec(raw["default"], f"{where}: default"),
                    rules=rules, keep=keep, awq=_options(AWQOptions, raw.get("awq"), f"{where}: awq"),
                    gptq=_options(GPTQOptions, raw.get("gptq"), f"{where}: gptq"), source=where,
                    on_indivisible=on_indivisible)
    if not 0 < recipe.awq.max_shrink < 1:
        raise ConfigError(f"{where}: awq.max_shrink must be in (0, 1), found {recipe.awq.max_shrink}")
    if recipe.awq.grid < 1 or recipe.awq.clip_grid < 1:
        raise ConfigError(f"{where}: awq.grid and awq.clip_grid must be >= 1")
    return recipe


def bundled_recipes() -> list[str]:
    return sorted(p.name for p in resources.files("dsquant.recipes").iterdir() if p.name.endswith(".yaml"))


def load_recipe(name_or_path: str) -> Recipe:
    """A recipe by path, or by the name of a bundled one (`awq-w4g128` or `awq-w4g128.yaml`)."""
    path = Path(name_or_path)
    if not path.exists():
        name = name_or_path if name_or_path.endswith(".yaml") else f"{name_or_path}.yaml"
        if name not in bundled_recipes():
            raise ConfigError(f"{name_or_path}: no such recipe file or bundled recipe; bundled: "
                              f"{', '.join(r[:-5] for r in bundled_recipes())}")
        path = Path(str(resources.files("dsquant.recipes") / name))
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    return parse_recipe(raw, str(path))
