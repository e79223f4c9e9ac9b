"""MoE experts backends: the reference loop on CPU, the fused Triton MoE on CUDA.

On CUDA, `FusedMoE.prepare(decoder_layer)` runs right after the layer's tensors load (before each
Linear repacks itself): the experts' per-module tensors are stacked into the fused kernel's
grouped layout (fused_moe.py: w13 = gate rows then up rows [E, 2I, H], w2 [E, H, I]) and the
per-expert tensors are dropped. Formats: bf16/fp16 experts as they are; AWQ INT4 experts through
int4_experts_from_awq; FP8 block experts through fp8_experts; GPTQ and compressed-tensors INT4
experts, and shapes the quantized grouped GEMMs refuse (ValueError), are dequantized once to the
model dtype and run as bf16 experts.
Shared experts are folded into the grouped experts when their linears have the routed experts'
format (dense, AWQ INT4 with the same group size, FP8 block) and the module is not expert parallel
(ExpertParallel renumbers this rank's routed experts and shards the shared MLP like a dense one):
the shared MLP of intermediate n*I is cut into n experts of width I, stacked after the E routed ones
(ids E .. E + n - 1), its tensors dropped; `runs_shared_experts(module)` tells MoE.forward to skip
it, and the routing gets n columns of weight 1 (moe_route's n_shared on the kernel path, else
with_shared_experts here). Otherwise the shared experts stay a dense GatedMLP. `experts` also takes
the shared MLP's output and the decoder layer's residual, so the kernel path (layers/fused.py
TritonMoE) ends the MoE block with one sum-and-add launch.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from dsquant.models.moe import LoopMoE, MoE

__all__ = ["FusedMoE", "LoopMoE"]
log = logging.getLogger(__name__)


FOLDABLE = ("dense", "awq", "fp8_block")
# checkpoint tensor -> (its out-features axis, its in-features axis)
AXES = {"weight": (0, 1), "weight_scale_inv": (0, 1), "qweight": (1, 0), "qzeros": (1, 0), "scales": (1, 0)}


def _stack(experts, proj: str, attr: str) -> torch.Tensor:
    return torch.stack([getattr(getattr(e, proj), attr) for e in experts])


def _method_key(linear):
    return type(linear.method), sorted(vars(linear.method).items())


def _shared_as_experts(module, routed) -> list:
    """module.shared_experts (intermediate n*I) as n stand-ins shaped like one routed expert (the
    same tensors, sliced: gate/up along out-features, down along in-features), or [] when they
    cannot join the routed experts' grouped weights."""
    shared, n = module.shared_experts, module.cfg.n_shared_experts
    if shared is None or not routed or not n:
        return []
    projs = ("gate_proj", "up_proj", "down_proj")
    linears = [getattr(m, p) for m in (routed[0], shared) for p in projs]
    if len({repr(_method_key(p)) for p in linears}) != 1 or linears[0].method.name not in FOLDABLE:
        return []
    parts = [{p: {} for p in projs} for _ in range(n)]
    for p in projs:
        ref = getattr(routed[0], p)
        for attr, t in getattr(shared, p)._parameters.items():
            if t is None:
                continue
            if attr not in AXES or getattr(ref, attr, None) is None:
                return []
            axis = AXES[attr][1 if p == "down_proj" else 0]
            if t.shape[axis] % n:
                return []
            for part, piece in zip(parts, t.chunk(n, dim=axis)):
                if piece.shape != getattr(ref, attr).shape or piece.dtype != getattr(ref, attr).dtype:
                    return []
                part[p][attr] = piece
    return [SimpleNamespace(**{p: SimpleNamespace(method=getattr(shared, p).method,
                                                  compute_dtype=getattr(shared, p).compute_dtype, **part[p])
                               for p in projs}) for part in parts]


class FusedMoE:
    """CUDA experts backend over runtime/kernels/moe/fused_moe.py."""

    def __init__(self):
        self.weights: dict = {}  # MoE module -> MoeWeights
        self.folded: dict = {}  # MoE module -> shared experts stacked after its routed ones

    def runs_shared_experts(self, module) -> bool:
        """Whether module's shared experts run inside its grouped experts (MoE.forward skips them)."""
        return self.folded.get(module, 0) > 0

    def num_folded(self, module) -> int:
        return self.folded.get(module, 0)

    def prepare(self, decoder_layer) -> None:
        module = decoder_layer.mlp
        if not isinstance(module, MoE):
            return
        from dsquant.runtime.kernels.moe.fused_moe import MoeWeights

        experts = [e for e in module.experts if e is not None]  # None: held by another rank (expert parallel)
        # folded shared experts have the routed ones' shapes, so they never change what is refused
        shared = _shared_as_experts(module, experts) if module.backend is self else []
        try:  # MoeWeights checks what the grouped GEMMs take (e.g. fp8: intermediate % 128 == 0)
            weights = MoeWeights(*self._grouped(module, experts + shared))
        except ValueError as e:  # a shape the quantized grouped GEMM does not take: run bf16 experts
            log.info("layer %d: %s; running the experts dequantized", decoder_layer.layer_idx, e)
            shared = []
            weights = MoeWeights(*self._grouped(module, experts, dense=True))
        self.weights[module] = weights
        self.folded[module] = len(shared)
        dropped = experts + ([module.shared_experts] if shared else [])
        for e in dropped:
            for proj in (e.gate_proj, e.up_proj, e.down_proj):
                proj._parameters.clear()

    def _grouped(self, module, experts, dense: bool = False):
        from dsquant.runtime.kernels.moe.fused_moe import bf16_experts

        method = "dense" if dense else experts[0].gate_proj.method.name
        if method == "awq":
            from dsquant.runtime.kernels.moe.fused_moe_int4 import int4_experts_from_awq

            g = experts[0].gate_proj.method.group_size
            cat = {a: torch.cat([_stack(experts, "gate_proj", a), _stack(experts, "up_proj", a)], dim=-1)
                   for a in ("qweight", "qzeros", "scales")}  # AWQ packs along N: concat N = rows of w13
            w13 = int4_experts_from_awq(cat["qweight"], cat["qzeros"], cat["scales"], g)
            w2 = int4_experts_from_awq(*(_stack(experts, "down_proj", a) for a in ("qweight", "qzeros", "scales")), g)
        elif method == "fp8_block":
            from dsquant.runtime.kernels.moe.fused_moe_fp8 import fp8_experts

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

    def experts(self, module, x, topk_ids, topk_weights, shared_output=None, residual=None, defer_sum=False):
        """x [T, hidden]; topk_ids, topk_weights [T, k]; shared_output, residual [T, hidden] or None
        -> [T, hidden]: the weighted expert sum (+ shared_output) (+ residual), the sum and adds in
        one launch (kernels/moe/moe_sum.py, rounding as the reference's separate adds); defer_sum:
        that launch's arguments (moe_sum.MoESumInputs), for the caller to sum later."""
        from dsquant.runtime.kernels.moe.fused_moe import fused_moe, with_shared_experts

        weights, n = self.weights[module], self.folded.get(module, 0)
        if n and topk_ids.shape[1] == module.gate.routing.top_k:  # routing without the shared columns
            topk_weights, topk_ids = with_shared_experts(topk_weights, topk_ids, weights.num_experts - n, n)
        return fused_moe(x, weights, topk_weights, topk_ids, shared_output, residual=residual, n_shared=n,
                         defer_sum=defer_sum)
