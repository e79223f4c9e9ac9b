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
    counts: dict[str, int] = field(default_factory=dict)  # rows kept in `rows` (strided, capped)
    seen: dict[str, int] = field(default_factory=dict)  # every input row the Linear saw (an expert: its tokens)
    hessians: dict[str, HessianAccumulator] = field(default_factory=dict)
    moe_inputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def take_inputs(self, names, device) -> dict[str, torch.Tensor]:
        """Each Linear's kept rows as one tensor [T, K] on `device`, moved out of `rows` (each part
        is freed once no other Linear holds it). Linears whose parts are the very same tensors (fed
        one input: an MLP's gate and up, MLA's q_a and kv_a) get one shared tensor."""
        out: dict[str, torch.Tensor] = {}
        made: dict[tuple, torch.Tensor] = {}
        # every part is alive (in `rows`) when the loop starts, so equal ids mean the same tensors
        for name in names:
            parts = self.rows.pop(name, None) or []
            key = tuple(id(p) for p in parts)
            if not key:
                out[name] = torch.empty(0, device=device)
            elif key in made:
                out[name] = made[key]
            else:
                x = parts[0] if len(parts) == 1 else torch.cat(parts)
                out[name] = made[key] = x.to(device)
            del parts
        return out


class LayerCapture:
    """Context manager: hooks on a layer's Linears (`names` maps module -> full name)."""

    def __init__(self, layer: nn.Module, prefix: str, gptq_names: set[str], max_rows: int, stride: int = 1):
        self.layer, self.prefix, self.max_rows = layer, prefix, max_rows
        self.stride = max(1, stride)  # keep every stride-th row, so rows spread over all samples
        self.gptq_names = gptq_names
        self.data = Captured()
        self.handles = []
        self.shared: dict[str, str] = {}  # GPTQ Linear -> the Linear whose Hessian (same input) it uses
        self._recent: dict[str, torch.Tensor] = {}  # the last GPTQ Linears' inputs (the very objects)
        self._last: tuple | None = None  # (input object, rows kept before it, rows taken) of the last hook

    def _linear_hook(self, name: str):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)
            self.data.seen[name] = self.data.seen.get(name, 0) + x.shape[0]
            if name in self.gptq_names:
                self._hessian(name, args[0], x)
            have = self.data.counts.get(name, 0)
            if have < self.max_rows and x.shape[0]:
                last = self._last
                if last is not None and last[0] is args[0] and last[1] == have:
                    take = last[2]  # fed what the last Linear was (gate then up): keep the rows once
                else:
                    take = x[:: self.stride][: self.max_rows - have].clone()
                    self._last = (args[0], have, take)
                self.data.rows.setdefault(name, []).append(take)
                self.data.counts[name] = have + take.shape[0]
        return hook

    def _hessian(self, name: str, source: torch.Tensor, x: torch.Tensor) -> None:
        """Accumulate x [T, K] into name's Hessian. Linears fed the very same tensor (an MLP's gate
        and up, MLA's q_a and kv_a) share one accumulator: a DeepSeek-V3 MoE layer then holds 256
        expert Hessians of 7168^2 fp32 (52 GB) instead of 512."""
        owner = self.shared.get(name)
        if owner is None and name not in self.data.hessians:
            owner = next((n for n, t in self._recent.items() if t is source), None)
            if owner is not None:  # first call: fed what a recent Linear was fed
                self.shared[name] = owner
                self.data.hessians[name] = self.data.hessians[owner]
        if owner is not None:
            if self._recent.get(owner) is not source:
                raise RuntimeError(f"{name}: its input was {owner}'s on the first batch but not now; "
                                   "the shared Hessian would be wrong")
            return
        acc = self.data.hessians.get(name)
        if acc is None:
            acc = self.data.hessians[name] = HessianAccumulator(x.shape[1], x.device)
        acc.add(x)
        self._recent.pop(name, None)
        self._recent[name] = source
        while len(self._recent) > 4:  # the inputs of the last few Linears, kept alive until replaced
            self._recent.pop(next(iter(self._recent)))

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
        self._recent.clear()
        self._last = None


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
        shared = None  # gate and up see the same rows: one Hessian
        for proj, rows in (("gate_proj", x), ("up_proj", x), ("down_proj", down_in)):
            name = f"{base}.{proj}"
            data.rows[name], data.counts[name] = [rows], rows.shape[0]
            if name in gptq_names:
                if proj == "down_proj" or shared is None:
                    acc = HessianAccumulator(rows.shape[1], rows.device)
                    acc.add(rows)
                    shared = acc
                data.hessians[name] = shared
    return fell_back
