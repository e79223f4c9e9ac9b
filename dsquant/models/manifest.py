"""The parts of an artifact's dsquant.json that `quantize` prints in its summary and `inspect` shows:
per-layer expert coverage and the modules that fell back from their recipe scheme on a shape.

dsquant.json (written by calibrate/pipeline.py) holds, besides the recipe, calibration and shards:
  "scheme_fallbacks": {full module name: {"from": "awq g128", "to": "awq g64" | "bf16", "reason"}}
  "layers": {"<i>": {"seconds", "fallback_experts": [expert index, ...],
                     "expert_tokens": {"n_experts", "min", "median", "max", "n_fallback",
                                       "counts": [tokens of expert 0, 1, ...]}}}  (MoE layers)
`expert_tokens` counts the calibration tokens the router sent to each routed expert. An expert
with too few captured rows is calibrated on all the layer's tokens instead (capture.expert_fallback);
more than FALLBACK_WARN_FRACTION of a layer's experts doing so means the calibration set is too
small for that layer, and is warned about.
"""
from __future__ import annotations

import json
import re
import statistics
from math import prod
from pathlib import Path

MANIFEST = "dsquant.json"
FALLBACK_WARN_FRACTION = 0.10


def expert_coverage(tokens: list[int], fallback: list[int]) -> dict | None:
    """Per-layer stats of routed tokens per expert, and the counts (None for a layer without experts)."""
    if not tokens:
        return None
    return {"n_experts": len(tokens), "min": min(tokens), "median": statistics.median(tokens),
            "max": max(tokens), "n_fallback": len(fallback), "counts": list(tokens)}


def coverage_warning(layer: str, cov: dict | None) -> str | None:
    """The warning for a layer where more than FALLBACK_WARN_FRACTION of the experts fell back."""
    if not cov or cov["n_fallback"] <= FALLBACK_WARN_FRACTION * cov["n_experts"]:
        return None
    return (f"layer {layer}: {cov['n_fallback']} of {cov['n_experts']} experts "
            f"({100 * cov['n_fallback'] / cov['n_experts']:.0f}%) got too few routed calibration tokens "
            f"(min {cov['min']}, median {cov['median']:g}) and were calibrated on all the layer's tokens; "
            "raise --n-samples (or --seqlen) so they see their own")


def _layer_order(item) -> int:
    return int(item[0])


def coverage_warnings(layers: dict[str, dict]) -> list[str]:
    """Warnings for every layer of a manifest's (or a resume state's) "layers"."""
    found = (coverage_warning(k, v.get("expert_tokens")) for k, v in sorted(layers.items(), key=_layer_order))
    return [w for w in found if w]


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    values, runs = sorted(set(values)), []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def fold_names(names) -> list[str]:
    """Module names with their numeric parts folded, each module still named exactly:
    model.layers.{1-2}.mlp.experts.{0-7}.down_proj (every combination present), else one line per
    value of the leading indices."""
    groups: dict[tuple, list[tuple]] = {}
    for name in names:
        parts = re.split(r"(?<=\.)(\d+)(?=\.|$)", name)
        groups.setdefault(tuple(parts[0::2]), []).append(tuple(int(i) for i in parts[1::2]))

    def render(texts, sets) -> str:
        out = texts[0]
        for values, text in zip(sets, texts[1:]):
            out += (str(values[0]) if len(values) == 1 else "{" + _ranges(values) + "}") + text
        return out

    lines = []
    for texts, idx in groups.items():
        sets = [sorted({t[p] for t in idx}) for p in range(len(texts) - 1)]
        if len(set(idx)) == prod(len(v) for v in sets):
            lines.append(render(texts, sets))
            continue
        by_head: dict[tuple, list[int]] = {}
        for t in idx:
            by_head.setdefault(t[:-1], []).append(t[-1])
        lines += [render(texts, [[h] for h in head] + [tail]) for head, tail in sorted(by_head.items())]
    return sorted(lines)


def fallback_lines(fallbacks: dict[str, dict]) -> list[str]:
    """'  awq g128 -> awq g64: model.layers.0.mlp.down_proj (group_size 128 does not divide ...)'."""
    kinds: dict[tuple, list[str]] = {}
    for name, f in fallbacks.items():
        kinds.setdefault((f["from"], f["to"], f["reason"]), []).append(name)
    return [f"  {a} -> {b}: {', '.join(fold_names(names))} ({why})" for (a, b, why), names in sorted(kinds.items())]


def coverage_lines(layers: dict[str, dict]) -> list[str]:
    """One line per MoE layer: routed tokens per expert (min / median / max) and how many fell back."""
    lines = []
    for k, v in sorted(layers.items(), key=_layer_order):
        cov = v.get("expert_tokens")
        if cov:
            lines.append(f"  layer {k}: {cov['n_experts']} experts, tokens min {cov['min']} / median "
                         f"{cov['median']:g} / max {cov['max']}, {cov['n_fallback']} fell back to all tokens"
                         + (f" ({v['fallback_experts']})" if v.get("fallback_experts") else ""))
    return lines


def read_manifest(model_dir: str | Path) -> dict | None:
    """dsquant.json of an artifact, or None when the directory has none (or it is not an object)."""
    path = Path(model_dir) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def manifest_report(manifest: dict) -> list[str]:
    """The calibration lines of an artifact (quantize's summary, inspect): fallbacks, coverage, warnings."""
    lines = []
    fallbacks = manifest.get("scheme_fallbacks") or {}
    if fallbacks:
        lines += [f"modules not on their recipe scheme ({len(fallbacks)}, recipe on_indivisible: "
                  f"{(manifest.get('recipe') or {}).get('on_indivisible', 'fallback')}):", *fallback_lines(fallbacks)]
    layers = manifest.get("layers") or {}
    coverage = coverage_lines(layers)
    if coverage:
        lines += ["expert coverage (routed calibration tokens per expert):", *coverage]
    lines += [f"warning: {w}" for w in coverage_warnings(layers)]
    return lines
