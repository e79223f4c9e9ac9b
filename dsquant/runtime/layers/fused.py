"""Kernel-path versions of the model's small ops: each decode step launches ~6 elementwise kernels
per torch RMSNorm, which on a 27-layer MoE model cost more GPU time than the attention.

`use_fused_ops(model)` (the engine calls it on CUDA when kernels are on) re-classes, in place:
  RMSNorm       -> TritonRMSNorm: one runtime/kernels/rmsnorm.py launch (x [..., H], weight [H])
  DecoderLayer  -> FusedAddNormDecoderLayer: the residual add after attention fused into
                   post_attention_layernorm (fused_add_rms_norm), one launch for add + norm.
Both keep the reference numerics (the sum rounded to the activation dtype, the normalised value
rounded before the weight multiply, as transformers does) and fall back to the torch forward on
CPU tensors. Weights and module names are untouched.
"""
from __future__ import annotations

import torch

from dsquant.models.causal_lm import DecoderLayer
from dsquant.models.layers import RMSNorm


class TritonRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return super().forward(x)
        from dsquant.runtime.kernels.rmsnorm import rms_norm

        return rms_norm(x, self.weight, self.eps)  # [..., H]


class FusedAddNormDecoderLayer(DecoderLayer):
    def forward(self, hidden: torch.Tensor, ctx) -> torch.Tensor:
        if not hidden.is_cuda:
            return super().forward(hidden, ctx)
        from dsquant.runtime.kernels.rmsnorm import fused_add_rms_norm

        # hidden [B, T, H]
        attn = self.self_attn(self.input_layernorm(hidden), ctx)
        norm = self.post_attention_layernorm
        normed, hidden = fused_add_rms_norm(attn, hidden, norm.weight, norm.eps)  # add, then norm
        return hidden + self.mlp(normed)


def use_fused_ops(model: torch.nn.Module) -> int:
    """Re-class the model's RMSNorm and DecoderLayer modules; returns how many were changed."""
    changed = 0
    for module in model.modules():
        if type(module) is RMSNorm:
            module.__class__ = TritonRMSNorm
            changed += 1
        elif type(module) is DecoderLayer:
            module.__class__ = FusedAddNormDecoderLayer
            changed += 1
    return changed
