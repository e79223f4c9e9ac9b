"""Quantize one decoder layer on its real inputs (the outputs of the already-quantized layers).

1. Capture: run the float layer over the calibration batch with hooks (capture.py).
2. AWQ scaling groups (MLA: input_layernorm -> q_a_proj/q_proj + kv_a_proj_with_mqa;
   q_a_layernorm -> q_b_proj; kv_a_layernorm -> kv_b_proj. GQA: input_layernorm -> q/k/v,
   v_proj -> o_proj when shapes allow. MLP: post_attention_layernorm -> gate/up of every
   routed and shared expert (the router's columns are scaled too, so routing is unchanged);
   each up_proj -> its down_proj), then the clip search on INT Linears except query/key ones.
   Groups are scored on the decoder layer's output (AWQ's module-to-inspect), except an MoE
   expert's up -> down, scored on that expert's own down_proj output: the routed experts in
   batched GEMMs (awq.search_scales_experts).
3. Quantize every Linear with its resolved scheme (the recipe's, or its shape fallback:
   resolve.py) (AWQ/RTN grid, GPTQ, FP8 block, BF16).
4. Write the dequantized weights back, so the next forward sees what inference will.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dsquant.calibrate import awq
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


def scaling_groups(layer: nn.Module, prefix: str):
    """[(producer module, producer kind, [member full names], passengers)] in layer order."""
    attn, mlp = layer.self_attn, layer.mlp
    a, m = f"{prefix}.self_attn", f"{prefix}.mlp"
    groups = []
    if hasattr(attn, "kv_a_proj_with_mqa"):  # MLA
        first = "q_proj" if attn.q_lora_rank is None else "q_a_proj"
        groups.append((layer.input_layernorm, "norm", [f"{a}.{first}", f"{a}.kv_a_proj_with_mqa"], []))
        if attn.q_lora_rank is not None:
            groups.append((attn.q_a_layernorm, "norm", [f"{a}.q_b_proj"], []))
        groups.append((attn.kv_a_layernorm, "norm", [f"{a}.kv_b_proj"], []))
    else:
        groups.append((layer.input_layernorm, "norm", [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"], []))
        if attn.v_proj.weight.shape[0] == attn.o_proj.weight.shape[1]:
            groups.append((attn.v_proj, "linear", [f"{a}.o_proj"], []))
    if isinstance(mlp, MoE):
        experts = [(f"{m}.experts.{i}", e) for i, e in enumerate(mlp.experts)]
        if mlp.shared_experts is not None:
            experts.append((f"{m}.shared_experts", mlp.shared_experts))
        members = [f"{n}.{p}" for n, _ in experts for p in ("gate_proj", "up_proj")]
        groups.append((layer.post_attention_layernorm, "norm", members, [mlp.gate]))
        groups += [(e.up_proj, "linear", [f"{n}.down_proj"], []) for n, e in experts]
    else:
        groups.append((layer.post_attention_layernorm, "norm", [f"{m}.gate_proj", f"{m}.up_proj"], []))
        groups.append((mlp.up_proj, "linear", [f"{m}.down_proj"], []))
    return groups


@torch.no_grad()
def _fold(producer: nn.Module, kind: str, members: list[nn.Linear], passengers: list, s: torch.Tensor):
    """Exact rescaling: producer output / s, member (and passenger) input columns * s."""
    if kind == "norm":
        producer.weight.div_(s.to(producer.weight.dtype))
    else:
        producer.weight.div_(s[:, None].to(producer.weight.dtype))
        if producer.bias is not None:
            producer.bias.div_(s.to(producer.bias.dtype))
    for mod in [*members, *passengers]:
        mod.weight.mul_(s[None, :].to(mod.weight.dtype))


def _rescale_inputs(inputs: dict[str, torch.Tensor], members: list[awq.Member], s: torch.Tensor) -> None:
    """inputs[n] / s [T, K] for the group's members once the fold has scaled their weights; members
    of one input key (one shared tensor) share the result."""
    done: dict[str, torch.Tensor] = {}  # input key -> its rescaled rows
    for m in members:
        if m.input_key not in done:
            done[m.input_key] = inputs[m.name] / s
        inputs[m.name] = done[m.input_key]


def _forward(layer: nn.Module, hidden: torch.Tensor, ctx, batch: int) -> torch.Tensor:
    """Run the layer over hidden [n, T, H] in batches; returns [n, T, H]."""
    out = torch.empty_like(hidden)
    with torch.no_grad():
        for i in range(0, hidden.shape[0], batch):
            out[i:i + batch] = layer(hidden[i:i + batch], ctx)
    return out


def _layer_output_loss(layer, linears, hidden, ctx, recipe: Recipe, batch: int):
    """AWQ's module-to-inspect, at the decoder-layer level: MSE of the layer's output on a few
    calibration sequences with the candidate weights swapped in for the group's members."""
    inspect = hidden[: recipe.awq.inspect_samples]  # [k, T, H]
    ref = _forward(layer, inspect, ctx, batch).to(torch.float32)

    def loss(weights: dict[str, torch.Tensor]) -> float:
        saved = {n: linears[n].weight.data for n in weights}
        try:
            for n, w in weights.items():
                linears[n].weight.data = w.to(saved[n].dtype)
            out = _forward(layer, inspect, ctx, batch).to(torch.float32)
        finally:
            for n, w in saved.items():
                linears[n].weight.data = w
        return float((out - ref).pow(2).mean())

    return loss


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

    if groups:
        block_loss = _layer_output_loss(layer, linears, hidden, ctx, recipe, batch) if recipe.awq.block_loss else None
        moe = isinstance(layer.mlp, MoE)
        routed: list = []  # MoE routed experts' up -> down groups: batched, each on its own output
        for producer, kind, names, passengers in groups:
            # the parameters themselves (no fp32 copy: a V3 MoE layer's 514 gate/up weights would take 30 GB);
            # each Linear is in one group, and its weight changes only when that group is folded
            members = [awq.Member(n, linears[n].weight.detach(), specs[n], inputs[n], data.key_of(n)) for n in names]
            if not any(m.spec.scheme == "awq" for m in members):
                tick("awq scales")
                continue
            if moe and kind == "linear" and ".mlp." in names[0]:  # an expert's up -> down
                if ".experts." in names[0] and len(members) == 1 and members[0].spec.scheme == "awq":
                    routed.append((producer, members[0]))
                    continue  # ticked once its batch of experts is searched
                s = awq.search_scales(members, recipe.awq, scale_dtype)  # the shared expert's own output
            else:
                s = awq.search_scales(members, recipe.awq, scale_dtype, block_loss)
            _fold(producer, kind, [linears[n] for n in names], passengers, s)
            _rescale_inputs(inputs, members, s)
            tick("awq scales")
        by_shape: dict = {}
        for producer, m in routed:
            by_shape.setdefault((tuple(m.weight.shape), m.spec), []).append((producer, m))
        for group in by_shape.values():
            scales = awq.search_scales_experts([m for _, m in group], recipe.awq, scale_dtype)
            for (producer, m), s in zip(group, scales):
                _fold(producer, "linear", [linears[m.name]], [], s)
                inputs[m.name] = inputs[m.name] / s
            tick("awq scales (experts)", len(group))
    clip = _expert_clip_ratios(linears, specs, inputs, data.key_of, recipe, scale_dtype)  # routed experts, batched

    weights, errors = {}, {}

    def finish(name: str, w: torch.Tensor, qw: QuantizedWeight) -> None:
        errors[name] = relative_output_error(inputs[name], w, qw.dequantized)
        with torch.no_grad():
            linears[name].weight.copy_(qw.dequantized.to(linears[name].weight.dtype))
        weights[name] = qw.compact()  # the layer holds the dequantized weight; export needs the codes
        tick(name[len(prefix) + 1:])

    for names in _expert_gptq_batches(linears, specs):  # routed experts' GPTQ, one shape at a time
        w = torch.stack([linears[n].weight.detach().to(torch.float32) for n in names])  # [E, N, K]
        h = torch.stack([data.hessians[n].h for n in names])  # [E, K, K]
        for n, w_e, qw in zip(names, w, gptq_quantize_batch(w, h, specs[names[0]], recipe.gptq, scale_dtype)):
            finish(n, w_e, qw)
        del w, h
    for name, lin in linears.items():
        if name in weights:
            continue
        spec, w = specs[name], lin.weight.detach().to(torch.float32)
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
        del qw, w
    return LayerResult({n: weights[n] for n in linears}, {n: errors[n] for n in linears}, fallback, tokens)


def _expert_clip_ratios(linears: dict[str, nn.Linear], specs: dict[str, SchemeSpec], inputs: dict[str, torch.Tensor],
                        key_of, recipe: Recipe, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The clip search's ratios [N, K/G] for the routed experts' AWQ Linears, searched in batches of
    one shape and spec (awq.search_clip_experts); other Linears are searched one by one.
    key_of(name): the Linear's input key (capture.Captured.key_of)."""
    if not recipe.awq.clip:
        return {}
    by_kind: dict[tuple, list[str]] = {}
    for n, s in specs.items():
        if s.scheme == "awq" and ".experts." in n and not n.endswith(NO_CLIP):
            by_kind.setdefault((tuple(linears[n].weight.shape), s), []).append(n)
    out = {}
    for (_, spec), names in by_kind.items():
        members = [awq.Member(n, linears[n].weight.detach(), spec, inputs[n], key_of(n)) for n in names]
        ratios = awq.search_clip_experts(members, recipe.awq, scale_dtype)
        out.update(zip(names, ratios))
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
