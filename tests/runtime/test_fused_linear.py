"""concat_linears: one QuantLinear of two (same input, outputs concatenated) gives exactly the two
outputs side by side, for every format it fuses (CPU path: dequantized weights); refuses pairs it
cannot fuse and leaves them untouched."""
import copy

import pytest
import torch

from dsquant.formats.awq_gemm import to_awq_tensors
from dsquant.formats.compressed_tensors import pack_quantized_tensors
from dsquant.formats.fp8_block import quantize_fp8_block
from dsquant.formats.gptq import to_gptq_tensors
from dsquant.formats.int_grid import quantize_int_groupwise
from dsquant.runtime.layers.compressed_tensors import CTFloat8Method, CTPackedInt4Method
from dsquant.runtime.layers.fused_linear import concat_linears
from dsquant.runtime.layers.linear import QuantLinear
from dsquant.runtime.layers.quant import AWQMethod, DenseMethod, FP8BlockMethod, GPTQMethod

K = 256


def _linear(fmt: str, n: int, seed: int) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    # [N, K], row magnitudes over three orders (varied group and block scales)
    w = torch.randn(n, K, generator=g) * 0.05 * 10 ** (torch.rand(n, 1, generator=g) * 3 - 2)
    if fmt == "dense":
        tensors, method = {"weight": w.to(torch.bfloat16)}, DenseMethod()
    elif fmt == "fp8_block":
        q, s = quantize_fp8_block(w)
        tensors, method = {"weight": q, "weight_scale_inv": s}, FP8BlockMethod()
    elif fmt.startswith("ct_fp8"):
        strategy = fmt.split("-")[1]
        if strategy == "block":
            q, s = quantize_fp8_block(w)
        else:
            s = w.abs().amax(1, keepdim=True) / 448  # [N, 1]
            q = (w / s).to(torch.float8_e4m3fn)
        tensors, method = {"weight": q, "weight_scale": s}, CTFloat8Method(strategy=strategy)
    else:
        q, scales, zeros = quantize_int_groupwise(w, 64)
        if fmt.startswith("ct_int4"):
            symmetric = fmt.endswith("sym") and not fmt.endswith("asym")
            if symmetric:
                zeros = torch.full_like(zeros, 8)  # codes kept: an encoding, not a fit
            tensors = pack_quantized_tensors(q, scales.to(torch.bfloat16), zeros)
            if symmetric:
                del tensors["weight_zero_point"]
            act_order = fmt.endswith("-ao")  # actorder "group": one channel order for both (one input)
            if act_order:
                perm = torch.randperm(K, generator=torch.Generator().manual_seed(99 if seed < 10 else seed))
                tensors = {**pack_quantized_tensors(q[:, perm], scales.to(torch.bfloat16), zeros),
                           "weight_g_idx": (perm // 64).to(torch.int32)}
            method = CTPackedInt4Method(group_size=64, symmetric=symmetric, g_idx=act_order)
        elif fmt == "awq":
            qw, qz, sc = to_awq_tensors(q, scales, zeros)
            tensors, method = {"qweight": qw, "qzeros": qz, "scales": sc}, AWQMethod(group_size=64)
        else:
            qw, qz, sc, gi = to_gptq_tensors(q, scales, zeros, 64)
            tensors, method = {"qweight": qw, "qzeros": qz, "scales": sc, "g_idx": gi}, GPTQMethod(group_size=64)
    lin = QuantLinear(method, f"layer.{fmt}{seed}", K, n, bias=False)
    lin.compute_dtype = torch.bfloat16
    for name, t in tensors.items():
        lin._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
    return lin


@pytest.mark.parametrize("fmt", ["dense", "fp8_block", "awq", "gptq", "ct_int4-asym", "ct_int4-sym", "ct_int4-ao",
                                 "ct_fp8-block", "ct_fp8-channel"])
def test_concat_equals_side_by_side(fmt):
    first, second = _linear(fmt, 384, 1), _linear(fmt, 200 if "fp8" in fmt else 72, 2)
    refs = []
    for m in (first, second):
        m = copy.deepcopy(m)
        m.method.process_weights_after_loading(m)
        refs.append(m)
    fused = concat_linears(first, second, "layer.fused")
    assert fused is not None and fused.out_features == first.out_features + second.out_features
    assert not list(first.parameters(recurse=False)) and not list(second.parameters(recurse=False))
    fused.method.process_weights_after_loading(fused)
    x = torch.randn(3, K, dtype=torch.bfloat16)
    expect = torch.cat([refs[0](x), refs[1](x)], dim=-1)
    torch.testing.assert_close(fused(x), expect, atol=0, rtol=0)


def test_refuses_what_it_cannot_fuse():
    a, b = _linear("fp8_block", 200, 1), _linear("fp8_block", 128, 2)  # first N off the 128 grid
    assert concat_linears(a, b, "x") is None
    assert list(a.parameters(recurse=False))  # untouched
    assert concat_linears(_linear("dense", 128, 1), _linear("awq", 128, 2), "x") is None
    a, b = _linear("ct_int4-asym", 128, 1), _linear("ct_int4-sym", 128, 2)  # symmetry differs
    assert concat_linears(a, b, "x") is None and list(a.parameters(recurse=False))
    a, b = _linear("ct_int4-ao", 128, 1), _linear("ct_int4-ao", 128, 12)  # two channel orders
    assert concat_linears(a, b, "x") is None and a.fusion_refused == "g_idx differ"
    a, b = _linear("ct_fp8-block", 128, 1), _linear("ct_fp8-block", 128, 2)
    b.method.dynamic_activations = True  # W8A16 beside W8A8
    assert concat_linears(a, b, "x") is None


def test_a_format_without_a_concatenation_rule_is_reported_as_a_runtime_fallback(monkeypatch):
    """A refusal for want of a rule (a runtime gap) is a fallback; different formats (a recipe's choice) are not."""
    from dsquant.runtime import fallbacks
    from dsquant.runtime.layers import fused_linear

    monkeypatch.delitem(fused_linear._CONCAT, "awq")
    a, b = _linear("awq", 128, 1), _linear("awq", 128, 2)
    assert concat_linears(a, b, "layer.fused") is None
    c, d = _linear("dense", 128, 1), _linear("awq", 128, 2)
    assert concat_linears(c, d, "layer.fused") is None
    model = torch.nn.ModuleDict({"q_a_proj": a, "other": c})
    assert fallbacks.kernel_fallbacks(model) == ["q_a_proj: not fused with kv_a_proj_with_mqa (no concatenation for awq)"]
