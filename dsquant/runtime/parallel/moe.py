"""Expert parallelism: each rank runs the routed experts it holds; the decoder layer's all-reduce of
the MoE output sums them.

Rank r holds experts [start, stop) of the global numbering (n_routed_experts / N of them); the
others are None in `MoE.experts`, so checkpoint names stay `mlp.experts.{global id}`. Routing is
replicated (every rank computes the same top-k), and each rank adds up its own experts'
weighted outputs; tokens routed elsewhere contribute zero here.
"""
from __future__ import annotations

import torch

from dsquant.models.moe import LoopMoE, sum_experts


class ExpertParallel:
    """Wraps the experts backend of one MoE module with this rank's expert range."""

    def __init__(self, inner, start: int, stop: int):
        self.inner, self.start, self.stop = inner, start, stop

    def runs_shared_experts(self, module) -> bool:
        return False  # the shared MLP is sharded like a dense one; MoE.forward adds its partial sum

    def prepare(self, decoder_layer) -> None:
        pass  # the model builder prepares the wrapped backend itself

    def experts(self, module, x, topk_ids, topk_weights):
        # x [T, hidden]; topk_ids (global ids), topk_weights [T, k] -> partial sum [T, hidden]
        if isinstance(self.inner, LoopMoE):
            return self._loop(module, x, topk_ids, topk_weights)
        # grouped backends (FusedMoE) stacked only the local experts: renumber from 0; assignments to
        # other ranks' experts get id -1 and weight 0, which fused_moe skips (no weight read, no row of
        # compute: moe_align drops them, the GEMVs and pair blocks read nothing, moe_sum skips weight 0)
        local = (topk_ids >= self.start) & (topk_ids < self.stop)
        ids = torch.where(local, topk_ids - self.start, torch.full_like(topk_ids, -1))
        return self.inner.experts(module, x, ids, topk_weights * local)

    def _loop(self, module, x, topk_ids, topk_weights):
        return sum_experts(module.experts, x, topk_ids, topk_weights, self.start, self.stop)
