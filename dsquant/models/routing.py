"""MoE routing: router scores -> top-k expert ids and weights, as DeepSeek V2 and V3 route.

Torch code (a handful of small ops, CUDA-graph capturable), shared by the reference model's
Router (models/moe.py) and the runtime's fused MoE, matching transformers 5.17's
DeepseekV2TopkRouter and DeepseekV3TopkRouter:
- scores: softmax (V2) or sigmoid (V3) of the fp32 router logits [T, E].
- "greedy": top-k of the scores.
- "group_limited_greedy" (V2): group score = max score in the group; keep the topk_group best
  groups, zero the rest, then top-k.
- "noaux_tc" (V3): choice scores = scores + e_score_correction_bias (the bias steers the choice
  only); group score = sum of the group's two best choice scores; keep topk_group groups, mask
  the rest to -inf, top-k of the choice scores; weights gathered from the unbiased scores.
Then, if norm_topk_prob, weights /= (sum + 1e-20), and weights *= routed_scaling_factor.
HF's V2 router ignores norm_topk_prob (DeepSeek's own V2 code honours it); here it is honoured
for every method, so pass norm_topk_prob=False to reproduce HF's V2 on a config that sets it.
DeepSeek's own V2 code also skips routed_scaling_factor when it normalises; V2 and V2-Lite ship
norm_topk_prob=False, where both agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_model(cls, cfg) -> "RoutingConfig":
        """From a dsquant.config.ModelConfig."""
        return cls(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.scoring_func, cfg.topk_method,
                   cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)

    def __post_init__(self):
        if self.scoring not in SCORING:
            raise ValueError(f"scoring_func must be one of {SCORING}, got {self.scoring!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.topk_method != "greedy":
            if self.num_experts % self.n_group:
                raise ValueError(f"n_group {self.n_group} does not divide n_routed_experts {self.num_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
            if self.top_k > self.topk_group * (self.num_experts // self.n_group):
                raise ValueError(f"num_experts_per_tok {self.top_k} exceeds the experts in "
                                 f"{self.topk_group} kept groups")


def router_logits(hidden: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """hidden [T, H], gate_weight [E, H] -> fp32 logits [T, E] (the router runs in fp32)."""
    return torch.nn.functional.linear(hidden.float(), gate_weight.float())


def _keep_top_groups(choice: torch.Tensor, group_scores: torch.Tensor, cfg: RoutingConfig,
                     fill: float) -> torch.Tensor:
    """choice [T, E], group_scores [T, n_group] -> choice with experts outside kept groups = fill."""
    t = choice.shape[0]
    group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)  # [T, n_group]
    per_group = cfg.num_experts // cfg.n_group
    expert_mask = group_mask.unsqueeze(-1).expand(t, cfg.n_group, per_group).reshape(t, -1)
    return choice.masked_fill(~expert_mask.bool(), fill)


def select_experts(logits: torch.Tensor, cfg: RoutingConfig,
                   e_score_correction_bias: torch.Tensor | None = None):
    """fp32 logits [T, E] -> (topk_weights fp32 [T, top_k], topk_ids int64 [T, top_k])."""
    if logits.shape[-1] != cfg.num_experts:
        raise ValueError(f"router logits have {logits.shape[-1]} experts, expected {cfg.num_experts}")
    scores = logits.softmax(dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()  # [T, E]
    t = scores.shape[0]
    if cfg.topk_method == "greedy":
        weights, ids = torch.topk(scores, k=cfg.top_k, dim=-1, sorted=False)
    elif cfg.topk_method == "group_limited_greedy":
        group_scores = scores.view(t, cfg.n_group, -1).max(dim=-1).values  # [T, n_group]
        masked = _keep_top_groups(scores, group_scores, cfg, 0.0)
        weights, ids = torch.topk(masked, k=cfg.top_k, dim=-1, sorted=False)
    else:
        if e_score_correction_bias is None:
            raise ValueError("topk_method 'noaux_tc' needs e_score_correction_bias [E]")
        choice = scores + e_score_correction_bias.float()  # [T, E]
        group_scores = choice.view(t, cfg.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
        masked = _keep_top_groups(choice, group_scores, cfg, float("-inf"))
        ids = torch.topk(masked, k=cfg.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def route(hidden: torch.Tensor, gate_weight: torch.Tensor, cfg: RoutingConfig,
          e_score_correction_bias: torch.Tensor | None = None):
    """hidden [T, H] -> (topk_weights fp32 [T, top_k], topk_ids int64 [T, top_k])."""
    return select_experts(router_logits(hidden, gate_weight), cfg, e_score_correction_bias)
