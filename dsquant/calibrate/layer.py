"""Quantize one decoder layer on its real inputs (the outputs of the already-quantized layers).

1. Capture: run the float layer over the calibration batch with hooks (capture.py).
2. AWQ: each scaling group's scale searched and folded in layer order (awq_layer.py), then the
   clip search on INT Linears except query/key ones; in sequential mode (AWQOptions.sequential)
   a group's AWQ / RTN members are quantized right after its fold, so later groups are scored
   on a layer whose earlier groups are quantized.
3. Quantize every Linear with its resolved scheme (the recipe's, or its shape fallback:
   resolve.py) (AWQ/RTN grid, GPTQ, FP8 block, BF16).
4. Write the dequantized weights back, so the next forward sees what inference will.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dsquant.calibrate import awq
from dsquant.calibrate.awq_layer import _forward, layer_output_loss, scaling_groups, search_layer
from dsquant.calibrate.capture import LayerCapture, expert_fallback
from dsquant.calibrate.gptq import gptq_quantize, gptq_quantize_batch
from dsquant.calibrate.quantizers import QuantizedWeight, fp8_block, int_grid, relative_output_error
from dsquant.calibrate.recipe import Recipe, SchemeSpec
from dsquant.errors import ConfigError
from dsquant.models.moe import MoE

MIN_EXPERT_ROWS = 32  # an expert with fewer captured rows is calibrated on all the layer's tokens
GPTQ_BATCH_BYTES = 6 << 30  # working set of one batch of experts' GPTQ
REPORT_ROWS = 4096  # input rows kept per Linear for its output-error report when no AWQ search runs
NO_CLIP = ("q_proj", "k_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")


@dataclass
class LayerResult:
    weights: dict[str, QuantizedWeight]  # full module name -> quantized weight
    errors: dict[str, float]  # full module name -> relative output error
    fallback_experts: list[int]
    expert_tokens: list[int] = field(default_factory=list)  # MoE: routed calibration tokens per expert


def _linears(layer: nn.Module, prefix: str) -> dict[str, nn.Linear]:
    return {f"{prefix}.{n}": m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}


def quantize_layer(layer: nn.Module, prefix: str, hidden: torch.Tensor, ctx, recipe: Recipe,
                   schemes: dict[str, SchemeSpec], scale_dtype: torch.dtype, batch: int = 8,
                   progress=None) -> LayerResult:
    """Quantize `layer` in place (weights become their dequantized values).

    schemes: full module name -> its resolved scheme (resolve.resolve_schemes), for every Linear
    of the layer; `recipe` gives the AWQ / GPTQ options.
    progress(done, total, what): called after each AWQ scaling group's search and each module's
    quantization (an MoE layer has one per expert projection), so a long layer shows movement."""
    linears = _linears(layer, prefix)
    missing = [n for n in linears if n not in schemes]
    if missing:
        raise ConfigError(f"recipe {recipe.name}: no resolved scheme for {missing[0]} (resolve_schemes "
                          "runs on the whole model before the first layer)")
    specs: dict[str, SchemeSpec] = {n: schemes[n] for n in linears}
    gptq_names = {n for n, s in specs.items() if s.scheme == "gptq"}
    for n, s in specs.items():
        if s.is_int and linears[n].weight.shape[1] % s.group_size:
            raise ConfigError(f"recipe {recipe.name}: group_size {s.group_size} does not divide "
                              f"in_features {linears[n].weight.shape[1]} of {n}")
    n_tokens = hidden.shape[0] * hidden.shape[1]
    # rows kept per Linear input: what the AWQ searches use, else only the error report's
    rows = recipe.awq.max_tokens if any(s.scheme == "awq" for s in specs.values()) else REPORT_ROWS
    stride = max(1, n_tokens // rows)
    with LayerCapture(layer, prefix, gptq_names, rows, stride) as data:
        _forward(layer, hidden, ctx, batch)
    fallback, tokens = [], []
    if isinstance(layer.mlp, MoE):
        tokens = [data.seen.get(f"{prefix}.mlp.experts.{e}.gate_proj", 0) for e in range(len(layer.mlp.experts))]
        fallback = expert_fallback(data, layer.mlp, f"{prefix}.mlp", MIN_EXPERT_ROWS, gptq_names)
    inputs = data.take_inputs(linears, hidden.device)  # Linears of one input key share one tensor

    groups = scaling_groups(layer, prefix) if any(s.scheme == "awq" for s in specs.values()) else []
    total, done = len(groups) + len(linears), 0

    def tick(what: str, n: int = 1) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total, what)

    weights, errors = {}, {}
    clip: dict[str, torch.Tensor] = {}  # routed experts' clip ratios, searched in batches

    def finish(name: str, w: torch.Tensor, qw: QuantizedWeight) -> None:
        errors[name] = relative_output_error(inputs[name], w, qw.dequantized)
        with torch.no_grad():
            linears[name].weight.copy_(qw.dequantized.to(linears[name].weight.dtype))
        weights[name] = qw.compact()  # the layer holds the dequantized weight; export needs the codes
        tick(name[len(prefix) + 1:])

    def quantize_one(name: str) -> None:
        spec, w = specs[name], linears[name].weight.detach().to(torch.float32)
        if spec.scheme in ("awq", "rtn"):
            ratio = 1.0
            if name in clip:
                ratio = clip.pop(name)
            elif spec.scheme == "awq" and recipe.awq.clip and not name.endswith(NO_CLIP):
                ratio = awq.search_clip(inputs[name], w, spec, recipe.awq, scale_dtype)
            qw = int_grid(w, spec, scale_dtype, clip_ratio=ratio)
        elif spec.scheme == "gptq":
            qw = gptq_quantize(w, data.hessians[name], spec, recipe.gptq, scale_dtype)
        elif spec.scheme == "fp8_block":
            qw = fp8_block(w, spec)
        else:
            qw = QuantizedWeight(spec, w)
        finish(name, w, qw)

    def quantize_now(names: list[str]) -> None:  # sequential AWQ: these Linears, right after their fold
        clip.update(_expert_clip_ratios(linears, specs, inputs, data.key_of, recipe, scale_dtype, names))
        for name in names:
            quantize_one(name)

    if groups:
        block_loss = layer_output_loss(layer, linears, hidden, ctx, recipe, batch) if recipe.awq.block_loss else None
        search_layer(layer, prefix, linears, specs, inputs, data.key_of, block_loss, recipe, scale_dtype, tick,
                     weights, quantize_now if recipe.awq.sequential else None)
    rest = [n for n in linears if n not in weights]
    clip.update(_expert_clip_ratios(linears, specs, inputs, data.key_of, recipe, scale_dtype, rest))  # batched

    for names in _expert_gptq_batches(linears, specs):  # routed experts' GPTQ, one shape at a time
        w = torch.stack([linears[n].weight.detach().to(torch.float32) for n in names])  # [E, N, K]
        h = torch.stack([data.hessians[n].h for n in names])  # [E, K, K]
        for n, w_e, qw in zip(names, w, gptq_quantize_batch(w, h, specs[names[0]], recipe.gptq, scale_dtype)):
            finish(n, w_e, qw)
        del w, h
    for name in linears:
        if name not in weights:
            quantize_one(name)
    return LayerResult({n: weights[n] for n in linears}, {n: errors[n] for n in linears}, fallback, tokens)


def _expert_clip_ratios(linears: dict[str, nn.Linear], specs: dict[str, SchemeSpec], inputs: dict[str, torch.Tensor],
                        key_of, recipe: Recipe, scale_dtype: torch.dtype, names: list[str]) -> dict[str, torch.Tensor]:
    """The clip search's ratios [N, K/G] for the routed experts' AWQ Linears among `names`, searched in
    batches of one shape and spec (awq.search_clip_experts); other Linears are searched one by one.
    key_of(name): the Linear's input key (capture.Captured.key_of)."""
    if not recipe.awq.clip:
        return {}
    by_kind: dict[tuple, list[str]] = {}
    for n in names:
        s = specs[n]
        if s.scheme == "awq" and ".experts." in n and not n.endswith(NO_CLIP):
            by_kind.setdefault((tuple(linears[n].weight.shape), s), []).append(n)
    out = {}
    for (_, spec), group in by_kind.items():
        members = [awq.Member(n, linears[n].weight.detach(), spec, inputs[n], key_of(n)) for n in group]
        ratios = awq.search_clip_experts(members, recipe.awq, scale_dtype)
        out.update(zip(group, ratios))
    return out


def _expert_gptq_batches(linears: dict[str, nn.Linear], specs: dict[str, SchemeSpec]) -> list[list[str]]:
    """Routed experts' GPTQ Linears in batches of one shape and spec, each batch's working set
    (Hessians and their inverses [E, K, K], weights, codes and dequantized copies [E, N, K], fp32)
    within GPTQ_BATCH_BYTES."""
    by_kind: dict[tuple, list[str]] = {}
    for n, s in specs.items():
        if s.scheme == "gptq" and ".experts." in n:
            by_kind.setdefault((tuple(linears[n].weight.shape), s), []).append(n)
    batches = []
    for ((n_out, k), _), names in by_kind.items():
        per_expert = 4 * (3 * k * k + 4 * n_out * k)
        size = max(1, GPTQ_BATCH_BYTES // per_expert)
        batches += [names[i:i + size] for i in range(0, len(names), size)]
    return batches


def layer_forward(layer: nn.Module, hidden: torch.Tensor, ctx, batch: int = 8) -> torch.Tensor:
    return _forward(layer, hidden, ctx, batch)
