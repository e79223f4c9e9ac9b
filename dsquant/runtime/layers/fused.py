"""Kernel-path versions of the model's small ops. Batch-1 decode is launch-bound (each small kernel
costs 3-5 us in a CUDA graph), so the many elementwise torch kernels per layer are replaced by one
Triton launch each; scripts/count_decode_ops.py counts them per layer.

Each class subclasses the plain module; with kernels on, the model builder (runtime/model_builder.py)
passes them in `Backends` (models/layers.py), so the model is built of them from the start:
  norm_cls           TritonRMSNorm: one runtime/kernels/ops/rmsnorm.py launch (x [..., H], weight [H])
  decoder_layer_cls  FusedAddNormDecoderLayer: the residual add after attention fused into
                     post_attention_layernorm (fused_add_rms_norm), one launch for add + norm; on
                     MoE layers the residual add after the MLP joins the experts' sum (TritonMoE);
                     with DEFER_MOE_SUM that sum runs inside the next layer's input norm launch
                     (moe_sum_rms_norm: the layer returns moe_sum.MoESumInputs; the last one sums its own).
  moe_cls            TritonMoE: on the FusedMoE backend, the routing emits the folded shared experts'
                     columns itself (moe_route n_shared), and the weighted top-k sum, the shared
                     experts' output and the decoder's residual add are one moe_sum.py launch. Not under
                     expert parallelism (ExpertParallel): its partial sums are all-reduced by the
                     decoder layer, so the residual must not be in them.
  router_cls         TritonRouter: fp32 logits from one GEMM (CUDA bf16/fp16: router_gemv.py up to
                     16 tokens, else cuBLAS with fp32 output, no casts; else an fp32 copy of the weight
                     made once), then softmax / sigmoid, grouped top-k, normalisation and scaling in one
                     moe_route.py launch.
  mlp_cls            TritonGatedMLP: silu(gate) * up in one activation.silu_mul launch.
  mla_cls            TritonMLAttention: q (or q_a) and kv_a projections as one GEMM when the loader
                     fused them (fused_linear.py, `fused_qkv_a`); with a backend that has `mla_fused`
                     (attention_triton.py), norm + rope + cache store + W_UK in one launch and split
                     merge + W_UV in another; with other backends q_pe and k_pe rotated in place by one
                     rope.py launch.
All keep the reference numerics up to fp32 rounding (sums rounded to the activation dtype, the
normalised value and silu(gate) rounded as transformers rounds them) and fall back to the torch
forward on CPU tensors unless TRITON_INTERPRET=1 (then the kernels run in the interpreter, as the
engine's CPU kernel-path tests want). Weights and module names are the plain modules'.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from dsquant.models.attention import MLAttention
from dsquant.models.causal_lm import DecoderLayer
from dsquant.models.layers import GatedMLP, RMSNorm
from dsquant.models.moe import MoE, Router
from dsquant.runtime.layers.linear import QuantLinear
from dsquant.runtime.layers.moe import FusedMoE


def runs_triton(t: torch.Tensor) -> bool:
    """Whether Triton kernels can take `t`: a CUDA tensor, or any tensor under the interpreter."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


class TritonRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not runs_triton(x):
            return super().forward(x)
        from dsquant.runtime.kernels.ops.rmsnorm import rms_norm

        return rms_norm(x, self.weight, self.eps)  # [..., H]


# The MoE expert sum deferred into the next layer's input norm launch. Off until timed on a GPU (the
# twenty-first session's device calls could not start a machine): DSQUANT_DEFER_MOE_SUM=1 turns it on.
DEFER_MOE_SUM = os.environ.get("DSQUANT_DEFER_MOE_SUM", "0") == "1"


class FusedAddNormDecoderLayer(DecoderLayer):
    def __init__(self, cfg, idx: int, backends):
        super().__init__(cfg, idx, backends)
        self.is_last = idx == cfg.num_hidden_layers - 1  # its output leaves the stack: never deferred

    def forward(self, hidden, ctx):
        """hidden [B, T, H], or the previous MoE layer's MoESumInputs (summed here, inside this
        layer's input norm launch) -> the same, for the next layer."""
        from dsquant.runtime.kernels.moe.moe_sum import MoESumInputs, moe_sum_rms_norm

        if isinstance(hidden, MoESumInputs):
            norm = self.input_layernorm
            if runs_triton(hidden.pieces):
                normed_in, hidden = moe_sum_rms_norm(hidden, norm.weight, norm.eps)
                return self._after_input_norm(normed_in, hidden, ctx)
            hidden = hidden.materialize()
        if not runs_triton(hidden):
            return super().forward(hidden, ctx)
        return self._after_input_norm(self.input_layernorm(hidden), hidden, ctx)

    def _after_input_norm(self, normed_in, hidden, ctx):
        from dsquant.runtime.kernels.ops.rmsnorm import fused_add_rms_norm

        attn = self.all_reduce(self.self_attn(normed_in, ctx))
        norm = self.post_attention_layernorm
        normed, hidden = fused_add_rms_norm(attn, hidden, norm.weight, norm.eps)  # add, then norm
        if isinstance(self.mlp, TritonMoE) and self.mlp.adds_residual():
            # experts' sum + shared + residual: one launch, or deferred into the next layer's input norm
            return self.mlp(normed, residual=hidden, defer_sum=DEFER_MOE_SUM and not self.is_last)
        return hidden + self.all_reduce(self.mlp(normed))


class TritonMoE(MoE):
    def adds_residual(self) -> bool:
        """Whether forward(x, residual) fuses the add: on FusedMoE itself, not wrapped for expert
        parallelism (the decoder layer's all-reduce of this module's output would sum the residual too)."""
        return isinstance(self.backend, FusedMoE)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, defer_sum: bool = False):
        # x, residual [..., hidden] -> residual + moe(x) (residual None: moe(x)); defer_sum on the
        # kernel path: that sum's arguments (moe_sum.MoESumInputs) for the next layer's norm to sum
        if not runs_triton(x) or not self.adds_residual():
            out = super().forward(x)
            return out if residual is None else residual + out
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, hidden]
        folded = self.backend.num_folded(self)  # shared experts run as experts E .. E + folded - 1
        weights, ids = self.gate(flat, n_shared=folded)  # [T, top_k + folded]
        shared = self.shared_experts(flat) if self.shared_experts is not None and not folded else None
        res = None if residual is None else residual.reshape(flat.shape)
        out = self.backend.experts(self, flat, ids, weights, shared_output=shared, residual=res, defer_sum=defer_sum)
        return dataclasses.replace(out, shape=shape) if defer_sum else out.view(shape)


class TritonRouter(Router):
    """weight [E, H]; weight_fp32: None, or its fp32 copy when logits cannot come from cuBLAS."""

    weight_fp32: torch.Tensor | None = None
    route_counters: torch.Tensor | None = None  # router_route's per-token counters, made on first use

    def _gemv_takes(self, x: torch.Tensor, max_t: int) -> bool:
        """Whether the router GEMVs (kernels/moe/router_gemv.py) take x [T, H] on this weight, T <= max_t."""
        w = self.weight
        return (x.shape[0] <= max_t and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
                and w.is_contiguous() and x.stride(-1) == 1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> fp32 [T, E] in one GEMM (the reference: linear(x.float(), weight.float()))."""
        w = self.weight
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype:
            from dsquant.runtime.kernels.moe.router_gemv import ROUTER_GEMV_MAX_T, router_logits

            if self._gemv_takes(x, ROUTER_GEMV_MAX_T):
                return router_logits(x, w)  # decode: one Triton GEMV launch
            return torch.mm(x, w.t(), out_dtype=torch.float32)  # bf16 products are exact in fp32
        if w.dtype != torch.float32 and self.weight_fp32 is None:
            self.weight_fp32 = w.float()  # once
        return torch.nn.functional.linear(x.float(), self.weight_fp32 if w.dtype != torch.float32 else w)

    def forward(self, x: torch.Tensor, n_shared: int = 0):
        """x [T, hidden] -> (topk_weights fp32 [T, k + n_shared], topk_ids [T, k + n_shared]): n_shared
        appends experts E .. E + n_shared - 1 with weight 1 (shared experts folded into the experts)."""
        if not runs_triton(x):
            out = super().forward(x)
            if not n_shared:
                return out
            from dsquant.runtime.kernels.moe.fused_moe import with_shared_experts

            return with_shared_experts(*out, self.weight.shape[0], n_shared)
        from dsquant.runtime.kernels.moe import router_gemv
        from dsquant.runtime.kernels.moe.moe_route import moe_route
        from dsquant.runtime.kernels.moe.router_gemv import ROUTER_GEMV_MAX_T

        c = self.routing
        w = self.weight
        if self._gemv_takes(x, ROUTER_GEMV_MAX_T) and router_gemv.fused_route_takes(x.shape[0], x.shape[1]):
            if self.route_counters is None or self.route_counters.device != x.device:
                self.route_counters = torch.zeros(router_gemv.ROUTER_GEMV_MAX_T, dtype=torch.int32, device=x.device)
            return router_gemv.router_route(x, w, self.route_counters, c.top_k, c.scoring, c.topk_method, c.n_group,
                                            c.topk_group, c.norm_topk_prob, c.routed_scaling_factor,
                                            self.e_score_correction_bias, n_shared=n_shared)  # one launch
        return moe_route(self.logits(x), c.top_k, c.scoring, c.topk_method, c.n_group, c.topk_group,
                         c.norm_topk_prob, c.routed_scaling_factor, self.e_score_correction_bias,
                         n_shared=n_shared)  # int32 ids


class TritonGatedMLP(GatedMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not runs_triton(x):
            return super().forward(x)
        from dsquant.runtime.kernels.ops.activation import silu_mul

        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))  # [..., I] -> [..., H]


class TritonMLAttention(MLAttention):
    def __init__(self, cfg, prefix: str, backends, backend):
        super().__init__(cfg, prefix, backends, backend)
        # q (or q_a) and kv_a as one linear, and its two output widths; set at load (fused_linear.py)
        self.fused_qkv_a: QuantLinear | None = None
        self.qkv_a_sizes: tuple[int, int] | None = None

    def project(self, x: torch.Tensor):
        if self.fused_qkv_a is None:
            return super().project(x)
        q, latent = self.fused_qkv_a(x).split(self.qkv_a_sizes, dim=-1)  # [B, T, Nq], [B, T, R + rope]
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q, latent

    def attend(self, q: torch.Tensor, latent: torch.Tensor, ctx):
        if self.backend.mla_fused is None or not runs_triton(q):  # the Triton paged backend's three-launch MLA
            return super().attend(q, latent, ctx)
        return self.backend.mla_fused(self, q, latent, ctx)  # [B, T, H, v]

    def rotate(self, q_pe: torch.Tensor, k_pe: torch.Tensor, ctx):
        if not runs_triton(q_pe):
            return super().rotate(q_pe, k_pe, ctx)
        from dsquant.runtime.kernels.ops.rope import apply_rope

        b, t = q_pe.shape[:2]
        half = self.qk_rope_head_dim // 2
        # in place on the views: q_pe [B*T, H, rope], k_pe [B*T, 1, rope]; cos/sin [B*T, rope/2]
        apply_rope(None, q_pe.view(b * t, self.num_heads, -1), k_pe.view(b * t, 1, -1),
                   ctx.cos.view(b * t, half), ctx.sin.view(b * t, half),
                   layout="interleaved" if self.rope_interleave else "neox")
        return q_pe, k_pe
