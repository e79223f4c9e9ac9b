"""AWQ over one decoder layer: its scaling groups, searched in layer order and folded exactly.

Scaling groups (MLA: input_layernorm -> q_a_proj/q_proj + kv_a_proj_with_mqa; q_a_layernorm ->
q_b_proj; kv_a_layernorm -> kv_b_proj. GQA: input_layernorm -> q/k/v, v_proj -> o_proj when shapes
allow. MLP: post_attention_layernorm -> gate/up of every routed and shared expert (the router's
columns are scaled too, so routing is unchanged); each up_proj -> its down_proj). Groups are scored
on the decoder layer's output (AWQ's module-to-inspect), except an MoE expert's up -> down, scored
on that expert's own down_proj output: the routed experts in batched GEMMs
(awq.search_scales_experts), after the other groups.

Sequential (AWQOptions.sequential): a group's AWQ and RTN members are quantized (their weights
replaced by the dequantized grid) as soon as its scale is folded, so a later group's layer-output
loss runs on a layer whose earlier groups are quantized, as inference will run it. A quantized
Linear that is a later group's producer (v_proj for o_proj, up_proj for down_proj) then has its
output rows divided by that group's scale: its codes and zero points stay and its scales are
divided (quantizers.rescale_rows), exact up to the scales' rounding to their export dtype.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dsquant.calibrate import awq
from dsquant.calibrate.quantizers import QuantizedWeight, rescale_rows
from dsquant.calibrate.recipe import Recipe, SchemeSpec
from dsquant.models.moe import MoE

EARLY = ("awq", "rtn")  # schemes sequential mode quantizes right after their group's fold (row-rescalable)


def scaling_groups(layer: nn.Module, prefix: str):
    """[(producer module, producer name, producer kind, [member full names], passengers)] in layer order."""
    attn, mlp = layer.self_attn, layer.mlp
    a, m = f"{prefix}.self_attn", f"{prefix}.mlp"
    ln_in, ln_post = f"{prefix}.input_layernorm", f"{prefix}.post_attention_layernorm"
    groups = []
    if hasattr(attn, "kv_a_proj_with_mqa"):  # MLA
        first = "q_proj" if attn.q_lora_rank is None else "q_a_proj"
        groups.append((layer.input_layernorm, ln_in, "norm", [f"{a}.{first}", f"{a}.kv_a_proj_with_mqa"], []))
        if attn.q_lora_rank is not None:
            groups.append((attn.q_a_layernorm, f"{a}.q_a_layernorm", "norm", [f"{a}.q_b_proj"], []))
        groups.append((attn.kv_a_layernorm, f"{a}.kv_a_layernorm", "norm", [f"{a}.kv_b_proj"], []))
    else:
        groups.append((layer.input_layernorm, ln_in, "norm", [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"], []))
        if attn.v_proj.weight.shape[0] == attn.o_proj.weight.shape[1]:
            groups.append((attn.v_proj, f"{a}.v_proj", "linear", [f"{a}.o_proj"], []))
    if isinstance(mlp, MoE):
        experts = [(f"{m}.experts.{i}", e) for i, e in enumerate(mlp.experts)]
        if mlp.shared_experts is not None:
            experts.append((f"{m}.shared_experts", mlp.shared_experts))
        members = [f"{n}.{p}" for n, _ in experts for p in ("gate_proj", "up_proj")]
        groups.append((layer.post_attention_layernorm, ln_post, "norm", members, [mlp.gate]))
        groups += [(e.up_proj, f"{n}.up_proj", "linear", [f"{n}.down_proj"], []) for n, e in experts]
    else:
        groups.append((layer.post_attention_layernorm, ln_post, "norm", [f"{m}.gate_proj", f"{m}.up_proj"], []))
        groups.append((mlp.up_proj, f"{m}.up_proj", "linear", [f"{m}.down_proj"], []))
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


def layer_output_loss(layer, linears, hidden, ctx, recipe: Recipe, batch: int):
    """AWQ's module-to-inspect, at the decoder-layer level: MSE of the layer's output on a few
    calibration sequences with the candidate weights swapped in for the group's members, against
    the float layer's output (computed here, before any fold or quantization)."""
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


def search_layer(layer: nn.Module, prefix: str, linears: dict[str, nn.Linear], specs: dict[str, SchemeSpec],
                 inputs: dict[str, torch.Tensor], key_of, block_loss, recipe: Recipe, scale_dtype: torch.dtype,
                 tick: Callable, weights: dict[str, QuantizedWeight],
                 quantize_now: Callable[[list[str]], None] | None = None) -> None:
    """Search and fold every scaling group's scale, in layer order; inputs are rescaled in place.

    block_loss: layer_output_loss(...) or None (each group on its members' own outputs).
    quantize_now(names), given in sequential mode: quantizes those Linears at once (layer.py), filling
    `weights` (full name -> compact QuantizedWeight); a fold into an already-quantized producer
    rescales its entry there and its layer weight. tick(what, n=1): progress."""
    moe = isinstance(layer.mlp, MoE)
    routed: list = []  # MoE routed experts' up -> down groups: batched, each on its own output
    for producer, producer_name, kind, names, passengers in scaling_groups(layer, prefix):
        # the parameters themselves (no fp32 copy: a V3 MoE layer's 514 gate/up weights would take 30 GB);
        # each Linear is in one group, and its weight changes only when that group is folded
        members = [awq.Member(n, linears[n].weight.detach(), specs[n], inputs[n], key_of(n)) for n in names]
        if not any(m.spec.scheme == "awq" for m in members):
            tick("awq scales")
            continue
        if moe and kind == "linear" and ".mlp." in names[0]:  # an expert's up -> down
            if ".experts." in names[0] and len(members) == 1 and members[0].spec.scheme == "awq":
                routed.append((producer, producer_name, members[0]))
                continue  # ticked once its batch of experts is searched
            s = awq.search_scales(members, recipe.awq, scale_dtype)  # the shared expert's own output
        else:
            s = awq.search_scales(members, recipe.awq, scale_dtype, block_loss)
        _apply(producer, producer_name, kind, members, passengers, s, linears, inputs, weights, scale_dtype,
               quantize_now)
        tick("awq scales")
    by_shape: dict = {}
    for producer, producer_name, m in routed:
        by_shape.setdefault((tuple(m.weight.shape), m.spec), []).append((producer, producer_name, m))
    for group in by_shape.values():
        scales = awq.search_scales_experts([m for _, _, m in group], recipe.awq, scale_dtype)
        for (producer, producer_name, m), s in zip(group, scales):
            _apply(producer, producer_name, "linear", [m], [], s, linears, inputs, weights, scale_dtype, None)
        if quantize_now is not None:  # no later search reads them; quantized now for the mode's sake
            quantize_now([m.name for _, _, m in group if m.spec.scheme in EARLY])
        tick("awq scales (experts)", len(group))


def _apply(producer, producer_name: str, kind: str, members: list[awq.Member], passengers: list, s: torch.Tensor,
           linears, inputs, weights: dict[str, QuantizedWeight], scale_dtype, quantize_now) -> None:
    """Fold scale s [K], rescale the members' inputs; a quantized producer keeps its codes (rescale_rows);
    in sequential mode (quantize_now given) quantize the group's AWQ / RTN members."""
    _fold(producer, kind, [linears[m.name] for m in members], passengers, s)
    _rescale_inputs(inputs, members, s)
    if kind == "linear" and producer_name in weights:
        qw = rescale_rows(weights[producer_name], s, scale_dtype)
        with torch.no_grad():
            linears[producer_name].weight.copy_(qw.dequantized.to(linears[producer_name].weight.dtype))
        weights[producer_name] = qw.compact()
    if quantize_now is not None:
        quantize_now([m.name for m in members if m.spec.scheme in EARLY])
