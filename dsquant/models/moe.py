"""DeepSeek mixture of experts: router (gate), routed experts, shared experts.

Routing (DeepSeek-V2 arXiv 2405.04434, DeepSeek-V3 arXiv 2412.19437):
- scores: softmax (V2) or sigmoid (V3) of the router logits, in fp32;
- greedy: top-k of the scores;
- group_limited_greedy: experts split into n_group groups, group score = max score in the
  group, keep the topk_group best groups, top-k within them;
- noaux_tc: choice uses scores + e_score_correction_bias, group score = sum of the top-2
  biased scores, the weights are the unbiased scores of the chosen experts;
- norm_topk_prob divides the weights by their sum; routed_scaling_factor multiplies them.
The experts themselves run through a pluggable backend; `LoopMoE` is the reference loop.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsquant.config import ModelConfig
from dsquant.models.layers import Backends, GatedMLP


def route(logits: torch.Tensor, bias: torch.Tensor | None, cfg: ModelConfig):
    """logits [T, E] fp32 -> (topk_weights [T, k] fp32, topk_ids [T, k] int64)."""
    t, e = logits.shape
    k = cfg.num_experts_per_tok
    scores = logits.softmax(-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    if cfg.topk_method == "greedy":
        weights, ids = torch.topk(scores, k, dim=-1, sorted=False)
    else:
        choice = scores if cfg.topk_method == "group_limited_greedy" else scores + bias
        grouped = choice.view(t, cfg.n_group, e // cfg.n_group)  # [T, G, E/G]
        if cfg.topk_method == "group_limited_greedy":
            group_scores = grouped.amax(-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        group_ids = torch.topk(group_scores, cfg.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1.0)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(t, e).bool()
        fill = 0.0 if cfg.topk_method == "group_limited_greedy" else float("-inf")
        ids = torch.topk(choice.masked_fill(~expert_mask, fill), k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
    if cfg.norm_topk_prob and k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class Router(nn.Module):
    """The MoE gate: weight [E, hidden] (kept in BF16 by every recipe) and the V3 bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, device="meta"))
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(cfg.n_routed_experts, device="meta"), requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor):
        logits = F.linear(x.to(torch.float32), self.weight.to(torch.float32))  # [T, E]
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias.float()
        return route(logits, bias, self.cfg)


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
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)
