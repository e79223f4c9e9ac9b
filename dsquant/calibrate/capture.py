"""Capture what each Linear of a decoder layer sees during calibration forwards.

Forward pre-hooks on every nn.Linear record up to `max_rows` input rows (fp32, on the layer's
device) for searches and error reports, and, for GPTQ Linears, accumulate the Hessian over all
calibration tokens. A hook on each MoE block records its input, so experts the router seldom
or never picks can still be calibrated on real tokens (`expert_fallback`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsquant.calibrate.gptq import HessianAccumulator
from dsquant.models.moe import MoE


@dataclass
class Captured:
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    hessians: dict[str, HessianAccumulator] = field(default_factory=dict)
    moe_inputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def inputs(self, name: str) -> torch.Tensor:
        parts = self.rows.get(name) or []
        return torch.cat(parts) if parts else torch.empty(0)


class LayerCapture:
    """Context manager: hooks on a layer's Linears (`names` maps module -> full name)."""

    def __init__(self, layer: nn.Module, prefix: str, gptq_names: set[str], max_rows: int, stride: int = 1):
        self.layer, self.prefix, self.max_rows = layer, prefix, max_rows
        self.stride = max(1, stride)  # keep every stride-th row, so rows spread over all samples
        self.gptq_names = gptq_names
        self.data = Captured()
        self.handles = []

    def _linear_hook(self, name: str):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)
            if name in self.gptq_names:
                acc = self.data.hessians.get(name)
                if acc is None:
                    acc = self.data.hessians[name] = HessianAccumulator(x.shape[1], x.device)
                acc.add(x)
            have = self.data.counts.get(name, 0)
            if have < self.max_rows and x.shape[0]:
                take = x[:: self.stride][: self.max_rows - have]
                self.data.rows.setdefault(name, []).append(take.clone())
                self.data.counts[name] = have + take.shape[0]
        return hook

    def _moe_hook(self, name: str):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)
            have = sum(t.shape[0] for t in self.data.moe_inputs.get(name, []))
            if have < self.max_rows:
                self.data.moe_inputs.setdefault(name, []).append(x[:: self.stride][: self.max_rows - have].clone())
        return hook

    def __enter__(self) -> Captured:
        for sub, module in self.layer.named_modules():
            full = f"{self.prefix}.{sub}" if sub else self.prefix
            if isinstance(module, nn.Linear):
                self.handles.append(module.register_forward_pre_hook(self._linear_hook(full)))
            elif isinstance(module, MoE):
                self.handles.append(module.register_forward_pre_hook(self._moe_hook(full)))
        return self.data

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


def expert_fallback(data: Captured, moe: MoE, moe_name: str, min_rows: int, gptq_names: set[str]) -> list[int]:
    """Give experts with fewer than `min_rows` routed rows the block's input tokens instead.

    Their gate/up inputs become the MoE input rows; their down_proj inputs are computed through
    the expert's own gate/up. Returns the indices of the experts that fell back.
    """
    mlp_in = torch.cat(data.moe_inputs.get(moe_name, [])) if data.moe_inputs.get(moe_name) else None
    if mlp_in is None:
        return []
    fell_back = []
    for e, expert in enumerate(moe.experts):
        base = f"{moe_name}.experts.{e}"
        if data.counts.get(f"{base}.gate_proj", 0) >= min_rows:
            continue
        fell_back.append(e)
        x = mlp_in
        with torch.no_grad():
            w_dtype = expert.gate_proj.weight.dtype
            xd = x.to(w_dtype)
            down_in = (F.silu(expert.gate_proj(xd)) * expert.up_proj(xd)).to(torch.float32)
        for proj, rows in (("gate_proj", x), ("up_proj", x), ("down_proj", down_in)):
            name = f"{base}.{proj}"
            data.rows[name], data.counts[name] = [rows], rows.shape[0]
            if name in gptq_names:
                acc = HessianAccumulator(rows.shape[1], rows.device)
                acc.add(rows)
                data.hessians[name] = acc
    return fell_back
