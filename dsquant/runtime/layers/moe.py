"""MoE experts backends: the reference loop on CPU, the fused Triton MoE on CUDA.

On CUDA, `FusedMoE.prepare(decoder_layer)` runs right after the layer's tensors load (before each
Linear repacks itself): the experts' per-module tensors are stacked into the fused kernel's
grouped layout (fused_moe.py: w13 = gate rows then up rows [E, 2I, H], w2 [E, H, I]) and the
per-expert tensors are dropped. Formats: bf16/fp16 experts as they are; AWQ INT4 experts through
int4_experts_from_awq; FP8 block experts through fp8_experts; GPTQ and compressed-tensors INT4
experts, and shapes the quantized grouped GEMMs refuse (ValueError), are dequantized once to the
model dtype and run as bf16 experts.
Shared experts stay a dense GatedMLP, added by the MoE module itself; `experts` also takes their
output and the decoder layer's residual, so the kernel path (layers/fused.py TritonMoE) ends the
MoE block with one sum-and-add launch.
"""
from __future__ import annotations

import logging

import torch

from dsquant.models.moe import LoopMoE, MoE

__all__ = ["FusedMoE", "LoopMoE"]
log = logging.getLogger(__name__)


def _stack(experts, proj: str, attr: str) -> torch.Tensor:
    return torch.stack([getattr(getattr(e, proj), attr) for e in experts])


class FusedMoE:
    """CUDA experts backend over runtime/kernels/fused_moe.py."""

    def __init__(self):
        self.weights: dict = {}  # MoE module -> MoeWeights

    def prepare(self, decoder_layer) -> None:
        module = decoder_layer.mlp
        if not isinstance(module, MoE):
            return
        from dsquant.runtime.kernels.fused_moe import MoeWeights

        experts = [e for e in module.experts if e is not None]  # None: held by another rank (expert parallel)
        try:  # MoeWeights checks what the grouped GEMMs take (e.g. fp8: intermediate % 128 == 0)
            weights = MoeWeights(*self._grouped(module, experts))
        except ValueError as e:  # a shape the quantized grouped GEMM does not take: run bf16 experts
            log.info("layer %d: %s; running the experts dequantized", decoder_layer.layer_idx, e)
            weights = MoeWeights(*self._grouped(module, experts, dense=True))
        self.weights[module] = weights
        for e in experts:
            for proj in (e.gate_proj, e.up_proj, e.down_proj):
                proj._parameters.clear()

    def _grouped(self, module, experts, dense: bool = False):
        from dsquant.runtime.kernels.fused_moe import bf16_experts

        method = "dense" if dense else experts[0].gate_proj.method.name
        if method == "awq":
            from dsquant.runtime.kernels.fused_moe_int4 import int4_experts_from_awq

            g = experts[0].gate_proj.method.group_size
            cat = {a: torch.cat([_stack(experts, "gate_proj", a), _stack(experts, "up_proj", a)], dim=-1)
                   for a in ("qweight", "qzeros", "scales")}  # AWQ packs along N: concat N = rows of w13
            w13 = int4_experts_from_awq(cat["qweight"], cat["qzeros"], cat["scales"], g)
            w2 = int4_experts_from_awq(*(_stack(experts, "down_proj", a) for a in ("qweight", "qzeros", "scales")), g)
        elif method == "fp8_block":
            from dsquant.runtime.kernels.fused_moe_fp8 import fp8_experts

            cat = {a: torch.cat([_stack(experts, "gate_proj", a), _stack(experts, "up_proj", a)], dim=1)
                   for a in ("weight", "weight_scale_inv")}
            w13 = fp8_experts(cat["weight"], cat["weight_scale_inv"].float())
            w2 = fp8_experts(_stack(experts, "down_proj", "weight"),
                             _stack(experts, "down_proj", "weight_scale_inv").float())
        else:
            def dense(proj):
                return torch.stack([getattr(e, proj).method.dequantized_weight(getattr(e, proj),
                                                                               getattr(e, proj).compute_dtype)
                                    for e in experts])
            w13 = bf16_experts(torch.cat([dense("gate_proj"), dense("up_proj")], dim=1).contiguous())
            w2 = bf16_experts(dense("down_proj").contiguous())
        return w13, w2

    def experts(self, module, x, topk_ids, topk_weights, shared_output=None, residual=None):
        """x [T, hidden]; topk_ids, topk_weights [T, k]; shared_output, residual [T, hidden] or None
        -> [T, hidden]: the weighted expert sum (+ shared_output) (+ residual), the sum and adds in
        one launch (kernels/moe_sum.py, rounding as the reference's separate adds)."""
        from dsquant.runtime.kernels.fused_moe import fused_moe

        return fused_moe(x, self.weights[module], topk_weights, topk_ids, shared_output, residual=residual)
