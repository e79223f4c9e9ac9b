"""One GEMM for two linears that read the same input: MLA's q projection (q_proj, or q_a_proj with
q LoRA) and kv_a_proj_with_mqa both project the attention input, so at load time (before either
repacks) their checkpoint tensors are concatenated along the output dimension into one QuantLinear
`fused_qkv_a` of the same format; TritonMLAttention splits its output. At batch-1 decode that
replaces two small GEMMs (on the H200, kv_a's 576 outputs took a cuBLAS split-K GEMM plus its
reduce, 7.6 us) by one slightly larger one.

Concatenation along N, per format (the tensors as the checkpoint stores them):
  dense      weight [N, K]                                  dim 0
  fp8_block  weight [N, K], weight_scale_inv [N/128, K/128]   dim 0; the first N must be a multiple of 128
  awq        qweight/qzeros [.., N/8], scales [.., N]        dim 1; N multiples of 8, same group size
  gptq       qweight/scales [.., N], qzeros [.., N/8]        dim 1; N multiples of 8, equal g_idx
  ct_int4    weight_packed [N, K/8], weight_scale [N, G],     dim 0; N multiples of 8; weight_shape
             weight_zero_point [N/8, G] (asymmetric only)     rewritten to [N1 + N2, K]; actorder
                                                              "group": equal weight_g_idx, kept
  ct_fp8     weight [N, K], weight_scale [N/128, K/128]       dim 0; block strategy: the first N a
             (block) or [N, 1] (channel)                      multiple of 128; tensor strategy not fused
The two methods must be equal (group size, symmetry, activation quantization, ...). Other formats,
biases, or mismatched methods keep the two linears.
"""
from __future__ import annotations

import copy
import logging

import torch

from dsquant.runtime.layers.fused import TritonMLAttention
from dsquant.runtime.layers.linear import QuantLinear
from dsquant.runtime.layers.quant import method_settings

log = logging.getLogger(__name__)

# format -> (checkpoint tensors concatenated, dim, multiple the first N must be of)
_CONCAT = {"dense": (("weight",), 0, 1), "fp8_block": (("weight", "weight_scale_inv"), 0, 128),
           "awq": (("qweight", "qzeros", "scales"), 1, 8), "gptq": (("qweight", "qzeros", "scales"), 1, 8),
           "ct_int4": (("weight_packed", "weight_scale", "weight_zero_point"), 0, 8),
           "ct_fp8": (("weight", "weight_scale"), 0, 128)}


UNSUPPORTED = "no concatenation for"  # the refusal that is a gap of the runtime, not a choice of the recipe


def _multiple(method) -> int:
    """The multiple the first linear's N must be of for the concatenation to keep the layout."""
    if method.name == "ct_fp8" and method.strategy == "channel":
        return 1
    return _CONCAT[method.name][2]


def concat_linears(first: QuantLinear, second: QuantLinear, prefix: str) -> QuantLinear | None:
    """A QuantLinear computing [first(x), second(x)] (loaded, not yet processed), or None when the
    pair cannot be fused (the reason is logged). Takes the two modules' checkpoint tensors."""
    fmt = first.method.name
    g_idx = first.method.g_idx_name  # kept whole: the pair shares its input
    why = None
    if fmt != second.method.name:
        why = f"formats {fmt} / {second.method.name}"
    elif fmt not in _CONCAT:
        why = f"{UNSUPPORTED} {fmt}"
    elif method_settings(first.method) != method_settings(second.method):
        why = f"{fmt} settings differ"
    elif fmt == "ct_fp8" and first.method.strategy == "tensor":
        why = "per-tensor FP8 scales"
    elif first.bias is not None or second.bias is not None:
        why = "biases"
    elif first.in_features != second.in_features:
        why = "input sizes differ"
    elif first.out_features % _multiple(first.method):
        why = f"{first.prefix} has {first.out_features} outputs, not a multiple of {_multiple(first.method)}"
    elif g_idx and not torch.equal(getattr(first, g_idx), getattr(second, g_idx)):
        why = "g_idx differ"  # act-order: one channel order for both (GPTQ gives one input one order)
    names, dim, _ = _CONCAT.get(fmt, ((), 0, 1))
    if fmt == "ct_int4" and first.method.symmetric:
        names = names[:2]  # symmetric: no zero points
    if why is None and any(m._parameters.get(t) is None for m in (first, second) for t in names):
        why = "tensors already repacked"
    if why is not None:
        log.debug("%s: not fused (%s)", prefix, why)
        first.fusion_refused = why  # read by runtime/fallbacks.py
        return None
    fused = QuantLinear(copy.copy(first.method), prefix, first.in_features,
                        first.out_features + second.out_features, bias=False)
    fused.compute_dtype = first.compute_dtype
    for name in names:
        a, b = getattr(first, name), getattr(second, name)
        if a.dtype != b.dtype:
            b = b.to(a.dtype)
        fused._parameters[name] = torch.nn.Parameter(torch.cat([a, b], dim=dim), requires_grad=False)
    if g_idx:
        fused._parameters[g_idx] = getattr(first, g_idx)
    if fmt == "ct_int4":  # the original [N, K] of the packed weight
        shape = torch.tensor([fused.out_features, first.in_features], dtype=torch.int64)
        fused._parameters["weight_shape"] = torch.nn.Parameter(shape, requires_grad=False)
    for m in (first, second):
        m._parameters.clear()  # the loader skips linears without tensors
    return fused


def fuse_mla_input_projections(decoder_layer) -> bool:
    """Give a kernel-path MLA layer `fused_qkv_a` (processed) and `qkv_a_sizes`; True if it did."""
    attn = decoder_layer.self_attn
    if not isinstance(attn, TritonMLAttention):
        return False
    first = attn.q_proj if attn.q_lora_rank is None else attn.q_a_proj
    prefix = first.prefix.rpartition(".")[0] + ".fused_qkv_a_proj"
    fused = concat_linears(first, attn.kv_a_proj_with_mqa, prefix)
    if fused is None:
        return False
    fused.method.process_weights_after_loading(fused)
    attn.qkv_a_sizes = (first.out_features, attn.kv_a_proj_with_mqa.out_features)
    attn.fused_qkv_a = fused
    return True
