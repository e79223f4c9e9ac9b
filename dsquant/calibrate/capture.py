"""Capture what each Linear of a decoder layer sees during calibration forwards.

Forward pre-hooks on every nn.Linear record up to `max_rows` input rows (fp32, on the layer's
device) for searches and error reports, and, for GPTQ Linears, accumulate the Hessian over all
calibration tokens. A hook on each MoE block records its input, so experts the router seldom
or never picks can still be calibrated on real tokens (`expert_fallback`).

Linears fed one tensor (an MLP's gate and up, attention's q/k/v, MLA's q_a and kv_a) read one
input: the hook tells so once, on the first batch, by the tensor itself, and names it in
`Captured.input_key` (the first Linear that read it). The kept rows and the Hessian are stored
once per input key, and every later step (take_inputs, awq.Member.input_key) groups by that name.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsquant.calibrate.gptq import HessianAccumulator
from dsquant.models.moe import MoE

RECENT_INPUTS = 4  # inputs the hooks remember (the very tensors) to tell a Linear fed one of them


@dataclass
class Captured:
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # input key -> kept rows' parts [t, K]
    counts: dict[str, int] = field(default_factory=dict)  # rows kept per Linear (strided, capped)
    seen: dict[str, int] = field(default_factory=dict)  # every input row the Linear saw (an expert: its tokens)
    hessians: dict[str, HessianAccumulator] = field(default_factory=dict)  # Linears of one input key share one
    moe_inputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    input_key: dict[str, str] = field(default_factory=dict)  # Linear -> its input's key (first Linear fed it)

    def key_of(self, name: str) -> str:
        return self.input_key.get(name, name)

    def take_inputs(self, names, device) -> dict[str, torch.Tensor]:
        """Each Linear's kept rows as one tensor [T, K] on `device`, moved out of `rows`. Linears of
        one input key get one shared tensor."""
        out: dict[str, torch.Tensor] = {}
        made: dict[str, torch.Tensor] = {}
        for name in names:
            key = self.key_of(name)
            if self.seen.get(name, 0) != self.seen.get(key, 0):
                raise RuntimeError(f"{name}: read {key}'s input on some batches only; their shared rows would be wrong")
            if key not in made:
                parts = self.rows.pop(key, None) or []
                if not parts:
                    made[key] = torch.empty(0, device=device)
                else:
                    made[key] = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(device)
                del parts
            out[name] = made[key]
        return out


@dataclass
class _Input:
    """One tensor a Linear read this batch: the tensor itself, its key, the rows kept of it (once,
    for every Linear that reads it) and whether its key's Hessian has counted it."""

    source: torch.Tensor
    key: str
    take: torch.Tensor | None = None
    in_hessian: bool = False


class LayerCapture:
    """Context manager: hooks on a layer's Linears (`names` maps module -> full name)."""

    def __init__(self, layer: nn.Module, prefix: str, gptq_names: set[str], max_rows: int, stride: int = 1):
        self.layer, self.prefix, self.max_rows = layer, prefix, max_rows
        self.stride = max(1, stride)  # keep every stride-th row, so rows spread over all samples
        self.gptq_names = gptq_names
        self.data = Captured()
        self.handles = []
        self._hessians: dict[str, HessianAccumulator] = {}  # input key -> its Hessian
        self._recent: list[_Input] = []  # the last few inputs, kept alive until replaced

    def _read(self, name: str, source: torch.Tensor) -> _Input:
        """The input `name` reads this batch: a recent Linear's when it is the very same tensor (the
        only identity check), else a new one keyed by `name`. A Linear's key is fixed on its first
        batch: its rows and Hessian are shared from then on."""
        found = next((r for r in self._recent if r.source is source), None)
        key = found.key if found is not None else name
        first = self.data.input_key.setdefault(name, key)
        if first != key:
            raise RuntimeError(f"{name}: its input was {first}'s on the first batch but not now; "
                               "the shared rows and Hessian would be wrong")
        if found is None:
            found = _Input(source, key)
            self._recent.append(found)
            del self._recent[:-RECENT_INPUTS]
        return found

    def _linear_hook(self, name: str):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1])  # [T, K] in the layer's dtype
            self.data.seen[name] = self.data.seen.get(name, 0) + x.shape[0]
            read = self._read(name, args[0])
            if name in self.gptq_names:
                self._hessian(name, read, x)
            have = self.data.counts.get(name, 0)
            if have < self.max_rows and x.shape[0]:
                if read.take is None:  # the first Linear to read it this batch keeps the rows, for all
                    read.take = x[:: self.stride][: self.max_rows - have].to(torch.float32, copy=True)  # [t, K]
                    self.data.rows.setdefault(read.key, []).append(read.take)
                self.data.counts[name] = have + read.take.shape[0]
        return hook

    def _hessian(self, name: str, read: _Input, x: torch.Tensor) -> None:
        """Accumulate x [T, K] into the Hessian of name's input key, once per input. Linears of one
        key share one accumulator: a DeepSeek-V3 MoE layer then holds 256 expert Hessians of
        7168^2 fp32 (52 GB) instead of 512."""
        acc = self._hessians.get(read.key)
        if acc is None:
            acc = self._hessians[read.key] = HessianAccumulator(x.shape[1], x.device)
        self.data.hessians[name] = acc
        if not read.in_hessian:
            acc.add(x)  # converts to fp32
            read.in_hessian = True

    def _moe_hook(self, name: str):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1])  # [T, hidden]
            have = sum(t.shape[0] for t in self.data.moe_inputs.get(name, []))
            if have < self.max_rows:
                take = x[:: self.stride][: self.max_rows - have].to(torch.float32, copy=True)
                self.data.moe_inputs.setdefault(name, []).append(take)
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
        self._hessians.clear()


def expert_fallback(data: Captured, moe: MoE, moe_name: str, min_rows: int, gptq_names: set[str]) -> list[int]:
    """Give experts with fewer than `min_rows` routed rows the block's input tokens instead.

    Their gate/up inputs become the MoE input rows (one input, keyed by gate_proj); their down_proj
    inputs are computed through the expert's own gate/up. Returns the indices of the experts that
    fell back.
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
        x = mlp_in  # [T, hidden]
        with torch.no_grad():
            w_dtype = expert.gate_proj.weight.dtype
            xd = x.to(w_dtype)
            down_in = (F.silu(expert.gate_proj(xd)) * expert.up_proj(xd)).to(torch.float32)  # [T, inter]
        gate, up, down = (f"{base}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
        data.input_key.update({gate: gate, up: gate, down: down})  # gate and up see the same rows
        data.rows[gate], data.rows[down] = [x], [down_in]
        data.rows.pop(up, None)
        for name, rows in ((gate, x), (up, x), (down, down_in)):
            data.counts[name] = rows.shape[0]
        hess = {}
        for name, rows in ((gate, x), (up, x), (down, down_in)):
            if name in gptq_names:
                key = data.input_key[name]
                if key not in hess:
                    hess[key] = HessianAccumulator(rows.shape[1], rows.device)
                    hess[key].add(rows)
                data.hessians[name] = hess[key]
    return fell_back
