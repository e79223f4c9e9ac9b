"""DeepSeek mixture of experts: router (gate), routed experts, shared experts.

Routing (softmax/sigmoid scores; greedy, group_limited_greedy, noaux_tc) is models/routing.py.
The experts themselves run through a pluggable backend (models.layers.MoEBackend); `LoopMoE` is the
reference loop. A backend may also run the shared experts (the runtime's FusedMoE stacks them with
the routed experts): it then answers True to `runs_shared_experts(module)` and MoE.forward does not
run them again. The router and expert MLP classes come from `Backends` (router_cls, mlp_cls).
"""
from __future__ import annotations

import torch
from torch import nn

from dsquant.config import ModelConfig
from dsquant.models.layers import Backends
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


def sum_experts(experts, x, topk_ids, topk_weights, first: int = 0, stop: int | None = None):
    """x [T, hidden], topk_ids / topk_weights [T, k] -> sum over each token's experts in
    [first, stop) of weight * expert(x) [T, hidden] (experts: a list indexed by global id; the
    others may be None, as on a tensor-parallel rank).

    The (token, slot) pairs are sorted by expert once, with one host sync for the counts (calibration
    runs this for every batch and block-loss candidate: a nonzero per expert synced 64 times).
    Within an expert the tokens stay in increasing order, and the experts are summed in increasing
    order, so the result is the per-expert nonzero loop's, bitwise."""
    stop = len(experts) if stop is None else stop
    out = torch.zeros_like(x, dtype=torch.float32)
    flat = topk_ids.flatten()  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k]
    counts = torch.bincount(flat.long(), minlength=len(experts)).tolist()
    token = order // topk_ids.shape[1]  # [T*k]
    weight = topk_weights.flatten()[order, None]  # [T*k, 1]
    start = 0
    for e, count in enumerate(counts):
        if count and first <= e < stop:
            rows = token[start:start + count]
            y = experts[e](x[rows])  # [n_e, hidden]
            out.index_add_(0, rows, y.to(torch.float32) * weight[start:start + count])
        start += count
    return out.to(x.dtype)


class LoopMoE:
    """Reference experts backend: for each expert hit, run its MLP on its tokens, weight, sum."""

    def runs_shared_experts(self, module: "MoE") -> bool:
        return False

    def prepare(self, decoder_layer) -> None:
        pass

    def experts(self, module: "MoE", x, topk_ids, topk_weights):
        return sum_experts(module.experts, x, topk_ids, topk_weights)


class MoE(nn.Module):
    """Routed experts (ModuleList, checkpoint keys mlp.experts.{i}.*) plus shared experts."""

    def __init__(self, cfg: ModelConfig, prefix: str, backends: Backends, backend):
        super().__init__()
        self.cfg = cfg
        self.gate = (backends.router_cls or Router)(cfg)
        here = backends.local(cfg.n_routed_experts)  # tensor parallel: None for other ranks' experts
        self.experts = nn.ModuleList(
            backends.mlp_cls(f"{prefix}.experts.{i}", cfg.hidden_size, cfg.moe_intermediate_size, backends)
            if i in here else None for i in range(cfg.n_routed_experts))
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = backends.mlp_cls(f"{prefix}.shared_experts", cfg.hidden_size,
                                                   cfg.moe_intermediate_size * cfg.n_shared_experts, backends)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [..., hidden]
        flat = x.reshape(-1, shape[-1])  # [T, hidden]
        weights, ids = self.gate(flat)
        out = self.backend.experts(self, flat, ids, weights)
        if self.shared_experts is not None and not self.backend.runs_shared_experts(self):
            out = out + self.shared_experts(flat)
        return out.view(shape)
