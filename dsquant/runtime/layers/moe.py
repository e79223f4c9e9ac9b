"""MoE experts backends: the reference loop on CPU, the fused Triton MoE on CUDA.

On CUDA, `FusedMoE.prepare(decoder_layer)` runs right after the layer's tensors load (before each
Linear repacks itself): the experts' per-module tensors are stacked into the fused kernel's
grouped layout (fused_moe.py: w13 = gate rows then up rows [E, 2I, H], w2 [E, H, I]) and the
per-expert tensors are dropped. Formats: bf16/fp16 experts as they are; INT4 experts of every
source (AWQ gemm, GPTQ v1/v2, compressed-tensors pack-quantized: each method's `int4_codes`) through
int4_experts, act-order GPTQ and compressed-tensors' actorder "group" with each expert's channel order
(GroupedWeight.perm, which the kernels gather the activations through); W8A8 FP8 block experts
(fp8_block, compressed-tensors block strategy: `fp8_block_tensors`) through fp8_experts. What the grouped GEMMs refuse (ValueError: group
sizes other than 32/64/128, off-grid shapes, gate and up with different act-order orders, FP8
channel/tensor scales or weight-only FP8, whose activations the FP8 grouped GEMM would quantize) is
dequantized once to the model dtype and runs as bf16 experts, with the reason logged.
Shared experts are folded into the grouped experts when their linears have the routed experts'
format and settings (FOLDABLE) and the module is not expert parallel
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

from dsquant.formats.gptq import is_plain_g_idx
from dsquant.models.moe import LoopMoE, MoE
from dsquant.runtime.layers.quant import method_settings

__all__ = ["FusedMoE", "LoopMoE"]
log = logging.getLogger(__name__)


FOLDABLE = ("dense", "awq", "gptq", "fp8_block", "ct_int4", "ct_fp8")
INT4 = ("awq", "gptq", "ct_int4")
FP8 = ("fp8_block", "ct_fp8")
# checkpoint tensor -> (its out-features axis, its in-features axis); AWQ and GPTQ share qweight / qzeros /
# scales' axes, compressed-tensors' weight_packed [N, K/8], weight_scale, weight_zero_point [N/8, G] theirs
AXES = {"weight": (0, 1), "weight_scale_inv": (0, 1), "qweight": (1, 0), "qzeros": (1, 0), "scales": (1, 0),
        "weight_packed": (0, 1), "weight_scale": (0, 1), "weight_zero_point": (0, 1)}
# tensors a stand-in does without: the packed shape (the codes carry it), a plain g_idx (the method's
# g_idx_name, checked below)
DERIVED = ("weight_shape",)


def _num_groups(linear) -> int:
    """Quantization groups along K: GPTQ scales [K/G, N], compressed-tensors weight_scale [N, K/G]."""
    return linear.scales.shape[0] if linear.method.name == "gptq" else linear.weight_scale.shape[1]


def _shared_as_experts(module, routed) -> list:
    """module.shared_experts (intermediate n*I) as n stand-ins shaped like one routed expert (the
    same tensors, sliced: gate/up along out-features, down along in-features), or [] when they
    cannot join the routed experts' grouped weights."""
    shared, n = module.shared_experts, module.cfg.n_shared_experts
    if shared is None or not routed or not n:
        return []
    projs = ("gate_proj", "up_proj", "down_proj")
    linears = [getattr(m, p) for m in (routed[0], shared) for p in projs]
    if len({method_settings(p.method) for p in linears}) != 1 or linears[0].method.name not in FOLDABLE:
        return []
    parts = [{p: {} for p in projs} for _ in range(n)]
    for p in projs:
        ref = getattr(routed[0], p)
        for attr, t in getattr(shared, p)._parameters.items():
            if t is None:
                continue
            g_idx = attr == getattr(shared, p).method.g_idx_name
            if g_idx and not is_plain_g_idx(t, _num_groups(getattr(shared, p))):
                if n != 1:  # act-order: a cut along K would split its groups, which are not runs of K
                    return []
                parts[0][p][attr] = t  # one stand-in, uncut: it keeps its channel order (int4_codes)
                continue
            if g_idx or attr in DERIVED:
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


def _int4_grouped(experts, projs: tuple[str, ...]):
    """GroupedWeight("int4") of each expert's `projs` (their rows concatenated), from the methods' codes;
    act-order GPTQ experts keep their channel orders (perm [E, K]: the kernels gather the activations),
    which the concatenated projections must share."""
    from dsquant.runtime.kernels.moe.fused_moe_int4 import int4_experts

    codes, zeros, scales, perms = [], [], [], []
    for e in experts:
        parts = [getattr(e, p).method.int4_codes(getattr(e, p)) for p in projs]
        orders = [perm for *_, perm in parts]
        if any(o is None for o in orders) != all(o is None for o in orders) or \
                any(o is not None and not torch.equal(o, orders[0]) for o in orders):
            raise ValueError(f"{' and '.join(projs)} of one expert have different act-order channel orders")
        codes.append(torch.cat([q for q, *_ in parts], dim=0).to(torch.uint8))  # [N, K], 0..15
        zeros.append(torch.cat([p[1] for p in parts], dim=1))  # [K/G, N]
        scales.append(torch.cat([p[2] for p in parts], dim=1))  # [K/G, N]
        perms.append(orders[0])  # [K] or None
    k, groups = codes[0].shape[1], zeros[0].shape[0]
    perm = None
    if any(p is not None for p in perms):  # experts without act-order take the identity
        plain = torch.arange(k, device=codes[0].device)
        perm = torch.stack([plain if p is None else p for p in perms])  # [E, K]
    return int4_experts(torch.stack(codes), torch.stack(zeros), torch.stack(scales), k // groups, perm=perm)


def _fp8_grouped(experts, projs: tuple[str, ...]):
    """GroupedWeight("fp8") of each expert's `projs` (rows, and rows of 128-blocks, concatenated)."""
    from dsquant.runtime.kernels.moe.fused_moe_fp8 import fp8_experts

    weights, scales = [], []
    for e in experts:
        parts = [getattr(e, p).method.fp8_block_tensors(getattr(e, p)) for p in projs]
        weights.append(torch.cat([w for w, _ in parts], dim=0))  # [N, K] e4m3
        scales.append(torch.cat([s for _, s in parts], dim=0).float())  # [N/128, K/128]
    return fp8_experts(torch.stack(weights), torch.stack(scales))


class FusedMoE:
    """CUDA experts backend over runtime/kernels/moe/fused_moe.py."""

    def __init__(self):
        self.weights: dict = {}  # MoE module -> MoeWeights
        self.folded: dict = {}  # MoE module -> shared experts stacked after its routed ones
        self.fallbacks: dict = {}  # MoE module -> why its quantized experts run dequantized (runtime/fallbacks.py)

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
        except ValueError as e:  # what the quantized grouped GEMMs do not take: run bf16 experts
            log.warning("layer %d: %s; running the experts dequantized (model dtype: more memory, slower)",
                        decoder_layer.layer_idx, e)
            self.fallbacks[module] = str(e)
            shared = []
            weights = MoeWeights(*self._grouped(module, experts, dense=True))
        self.weights[module] = weights
        self.folded[module] = len(shared)
        dropped = experts + ([module.shared_experts] if shared else [])
        for e in dropped:
            for proj in (e.gate_proj, e.up_proj, e.down_proj):
                proj._parameters.clear()

    def _grouped(self, module, experts, dense: bool = False):
        """-> (w13, w2) GroupedWeights of `experts` (gate and up rows concatenated in w13); a
        ValueError for what the quantized grouped GEMMs do not take."""
        from dsquant.runtime.kernels.moe.fused_moe import bf16_experts

        method = experts[0].gate_proj.method
        name = "dense" if dense else method.name
        if name in INT4 + FP8:
            keys = {method_settings(getattr(e, p).method) for e in experts for p in ("gate_proj", "up_proj", "down_proj")}
            if len(keys) != 1:
                raise ValueError(f"the experts' {name} settings differ")
        if name in INT4:
            return _int4_grouped(experts, ("gate_proj", "up_proj")), _int4_grouped(experts, ("down_proj",))
        if name in FP8:
            if not method.dynamic_activations:
                raise ValueError("weight-only FP8 experts (the FP8 grouped GEMM quantizes the activations)")
            return _fp8_grouped(experts, ("gate_proj", "up_proj")), _fp8_grouped(experts, ("down_proj",))

        def dense_stack(proj):
            return torch.stack([getattr(e, proj).method.dequantized_weight(getattr(e, proj),
                                                                           getattr(e, proj).compute_dtype)
                                for e in experts])
        w13 = bf16_experts(torch.cat([dense_stack("gate_proj"), dense_stack("up_proj")], dim=1).contiguous())
        w2 = bf16_experts(dense_stack("down_proj").contiguous())
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
