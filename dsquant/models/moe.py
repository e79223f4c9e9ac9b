"""DeepSeek mixture of experts: router (gate), routed experts, shared experts.

Routing (softmax/sigmoid scores; greedy, group_limited_greedy, noaux_tc) is models/routing.py.
The experts themselves run through a pluggable backend; `LoopMoE` is the reference loop. A backend
may also run the shared experts (the runtime's FusedMoE stacks them with the routed experts): it
then answers True to `runs_shared_experts(module)` and MoE.forward does not run them again.
"""
from __future__ import annotations

import torch
from torch import nn

from dsquant.config import ModelConfig
from dsquant.models.layers import Backends, GatedMLP
from dsquant.models.routing import RoutingConfig, route


class Router(nn.Module):
    """The MoE gate: weight [E, hidden] (kept in BF16 by every recipe) and the V3 bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.routing = RoutingConfig.from_model(cfg)
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, device="meta"))
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(cfg.n_routed_experts, device="meta"), requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor):
        # x [T, hidden] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64)
        return route(x, self.weight, self.routing, self.e_score_correction_bias)


def backend_runs_shared(backend, module: "MoE") -> bool:
    """Whether `backend` runs module's shared experts itself (backends without the method do not)."""
    runs = getattr(backend, "runs_shared_experts", None)
    return runs is not None and runs(module)


class LoopMoE:
    """Reference experts backend: for each expert hit, run its MLP on its tokens, weight, sum."""

    def experts(self, module: "MoE", x, topk_ids, topk_weights):
        # x [T, hidden]; topk_ids, topk_weights [T, k]
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in torch.unique(topk_ids).tolist():
            token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
            y = module.experts[e](x[token])  # [n_e, hidden]
            out.index_add_(0, token, y.to(torch.float32) * topk_weights[token, slot, None])
        return out.to(x.dtype)


class MoE(nn.Module):
    """Routed experts (ModuleList, checkpoint keys mlp.experts.{i}.*) plus shared experts."""

    def __init__(self, cfg: ModelConfig, prefix: str, backends: Backends, backend):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(
            GatedMLP(f"{prefix}.experts.{i}", cfg.hidden_size, cfg.moe_intermediate_size, backends)
            for i in range(cfg.n_routed_experts))
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(f"{prefix}.shared_experts", cfg.hidden_size,
                                           cfg.moe_intermediate_size * cfg.n_shared_experts, backends)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [..., hidden]
        flat = x.reshape(-1, shape[-1])  # [T, hidden]
        weights, ids = self.gate(flat)
        out = self.backend.experts(self, flat, ids, weights)
        if self.shared_experts is not None and not backend_runs_shared(self.backend, self):
            out = out + self.shared_experts(flat)
        return out.view(shape)
