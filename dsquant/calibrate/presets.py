"""`dsquant quantize --scheme NAME`: llm-compressor's preset scheme names as dsquant recipes.

| --scheme    | weights                                   | --algorithm (first: default) | native format |
| ----------- | ----------------------------------------- | ---------------------------- | ------------- |
| W4A16       | INT4 symmetric, group 128 (--group-size)  | gptq                         | gptq          |
| W4A16_ASYM  | INT4 asymmetric (zero points), group 128  | awq, rtn, gptq               | awq (gptq for gptq) |
| FP8_BLOCK   | FP8 e4m3 in 128x128 blocks, dynamic acts  | rtn (no calibration)         | fp8           |

dsquant's AWQ and RTN grids are asymmetric, so W4A16 (symmetric, as llm-compressor defines it)
is produced by GPTQ only. Activations stay 16-bit for the W4A16 schemes. The recipe is built
as a YAML mapping and parsed by `parse_recipe`, so it is checked exactly like a recipe file;
--ignore patterns join the keep list (modules left in BF16).
"""
from __future__ import annotations

from dsquant.calibrate.recipe import GROUP_SIZES, Recipe, parse_recipe
from dsquant.errors import ConfigError

DEFAULT_KEEP = ["lm_head", "*.embed_tokens", "*.mlp.gate", "*norm"]
# scheme -> its algorithms (dsquant schemes), the first being the default
PRESETS = {
    "W4A16": ("gptq",),
    "W4A16_ASYM": ("awq", "rtn", "gptq"),
    "FP8_BLOCK": ("rtn",),
}
NOT_PRODUCED = {
    "FP8_DYNAMIC": "per-channel FP8 weights are not produced; FP8_BLOCK is dsquant's FP8",
    "FP8": "static per-tensor FP8 is not produced; FP8_BLOCK is dsquant's FP8",
    "W8A16": "INT8 weights are not produced",
    "W8A8": "INT8 weights and activations are not produced",
    "W4A8": "INT8 activations are not produced",
    "NVFP4": "FP4 is not produced",
    "NVFP4A16": "FP4 is not produced",
    "MXFP4": "FP4 is not produced",
}
WHY = {("W4A16", "awq"): "dsquant's AWQ is asymmetric: use --scheme W4A16_ASYM --algorithm awq",
       ("W4A16", "rtn"): "dsquant's RTN is asymmetric: use --scheme W4A16_ASYM --algorithm rtn"}


def scheme_names() -> str:
    return ", ".join(PRESETS)


def preset_recipe(scheme: str, algorithm: str | None = None, group_size: int | None = None,
                  ignore: list[str] | tuple[str, ...] = ()) -> Recipe:
    """The recipe of `--scheme scheme --algorithm algorithm --group-size G --ignore P...`."""
    key = scheme.upper()
    if key in NOT_PRODUCED:
        raise ConfigError(f"--scheme {scheme}: {NOT_PRODUCED[key]}; expected one of {scheme_names()}")
    if key not in PRESETS:
        raise ConfigError(f"--scheme {scheme}: unknown scheme; expected one of {scheme_names()}")
    algorithms = PRESETS[key]
    algorithm = (algorithm or algorithms[0]).lower()
    if algorithm not in algorithms:
        why = WHY.get((key, algorithm), f"--scheme {key} takes --algorithm {', '.join(algorithms)}")
        raise ConfigError(f"--scheme {key} --algorithm {algorithm}: {why}")
    if key == "FP8_BLOCK":
        if group_size is not None:
            raise ConfigError("--group-size: FP8_BLOCK uses 128x128 blocks; --group-size applies to W4A16 schemes")
        default = {"scheme": "fp8_block"}
        name = "fp8-block"
    else:
        group = 128 if group_size is None else group_size
        if group not in GROUP_SIZES:
            raise ConfigError(f"--group-size {group}: expected one of {', '.join(map(str, GROUP_SIZES))}")
        default = {"scheme": algorithm, "bits": 4, "group_size": group}
        name = f"{key.lower().replace('_', '-')}-{algorithm}-g{group}"
    raw = {"name": name, "default": default, "keep": DEFAULT_KEEP + list(ignore)}
    if algorithm == "gptq":
        raw["gptq"] = {"sym": key == "W4A16"}
    return parse_recipe(raw, f"--scheme {key}")
