"""Quantized-linear methods on CPU: apply(x) equals x @ W^T for the weight each format encodes,
with W built here from the integer codes / fp8 values and scales, independently of the method."""
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from dsquant.formats.awq_gemm import pack_awq
from dsquant.formats.fp8_block import quantize_fp8_activations, quantize_fp8_block
from dsquant.formats.gptq import pack_gptq_qweight, pack_gptq_qzeros
from dsquant.runtime.layers.compressed_tensors import CTFloat8Method, CTPackedInt4Method
from dsquant.runtime.layers.linear import LinearFactory, QuantLinear
from dsquant.runtime.layers.quant import AWQMethod, DenseMethod, FP8BlockMethod, GPTQMethod

N, K, G = 48, 128, 32


def fill(layer: QuantLinear, tensors: dict) -> QuantLinear:
    for name, t in tensors.items():
        meta = layer._parameters[name]
        assert tuple(meta.shape) == tuple(t.shape), name
        layer._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
    layer.compute_dtype = torch.float32
    layer.method.process_weights_after_loading(layer)
    return layer


def codes(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g)  # [N, K] unsigned codes
    z = torch.randint(1, 16, (N, K // G), generator=g)  # [N, G]
    s = (torch.rand(N, K // G, generator=g) * 0.05 + 0.01).half().float()  # fp16-exact scales
    return q, z, s


def grouped_weight(q, z, s, g_idx):
    return (q - z[:, g_idx]).float() * s[:, g_idx]  # [N, K]


def check(layer, w_ref):
    x = torch.randn(5, K)
    torch.testing.assert_close(layer(x), x @ w_ref.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.method.dequantized_weight(layer, torch.float32), w_ref)


def test_awq():
    q, z, s = codes()
    layer = QuantLinear(AWQMethod(group_size=G), "m", K, N, False)
    fill(layer, {"qweight": pack_awq(q.t()), "qzeros": pack_awq(z.t()),
                 "scales": s.t().contiguous().half()})
    check(layer, grouped_weight(q, z, s, torch.arange(K) // G))


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq(act_order):
    q, z, s = codes(1)
    g_idx = torch.arange(K) // G
    if act_order:  # desc_act: channels visited in a random order, groups follow that order
        perm = torch.randperm(K, generator=torch.Generator().manual_seed(2))
        g_idx = torch.empty(K, dtype=torch.long)
        g_idx[perm] = torch.arange(K) // G
    layer = QuantLinear(GPTQMethod(group_size=G), "m", K, N, True)
    bias = torch.randn(N)
    fill(layer, {"qweight": pack_gptq_qweight(q.t()), "qzeros": pack_gptq_qzeros(z.t()),
                 "scales": s.t().contiguous().half(), "g_idx": g_idx.to(torch.int32), "bias": bias})
    x = torch.randn(3, K)
    torch.testing.assert_close(layer(x), x @ grouped_weight(q, z, s, g_idx).t() + bias, rtol=1e-5, atol=1e-5)


def test_fp8_block_with_partial_blocks():
    n, k = 200, 300
    w = torch.randn(n, k)
    fp8, scale_inv = quantize_fp8_block(w)
    layer = QuantLinear(FP8BlockMethod(), "m", k, n, False)
    fill(layer, {"weight": fp8, "weight_scale_inv": scale_inv})
    per_elem = scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    x = torch.randn(4, k)
    # W8A8 (activation_scheme dynamic): x quantized per token and 128 channels, partial last group
    xq, xs = quantize_fp8_activations(x)  # [4, k], [4, 3]
    assert xs.shape == (4, 3)
    x_used = xq.float() * xs.repeat_interleave(128, 1)[:, :k]
    assert 0 < (x_used - x).abs().max() <= x.abs().max() / 16  # quantized, within e4m3's step
    torch.testing.assert_close(layer(x), x_used @ (fp8.float() * per_elem).t(), rtol=1e-5, atol=1e-4)
    exact = x @ w.t()  # and the product stays close to the exact one (e4m3: 3 mantissa bits)
    assert (layer(x) - exact).norm() < 0.08 * exact.norm()
    weight_only = QuantLinear(FP8BlockMethod(dynamic_activations=False), "m", k, n, False)
    fill(weight_only, {"weight": fp8, "weight_scale_inv": scale_inv})
    torch.testing.assert_close(weight_only(x), x @ (fp8.float() * per_elem).t(), rtol=1e-5, atol=1e-4)


def test_ct_fp8_activation_scheme_follows_input_activations():
    from dsquant.runtime.layers.compressed_tensors import ct_method

    weights = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}
    acts = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}
    assert ct_method(weights, "float-quantized", acts).dynamic_activations
    assert not ct_method(weights, "float-quantized", None).dynamic_activations
    assert LinearFactory({"quant_method": "fp8"}).scheme_for("model.layers.0.mlp.up_proj").dynamic_activations


@pytest.mark.parametrize("symmetric", [False, True])
def test_compressed_tensors_pack_quantized(symmetric):
    q, z, s = codes(3)
    if symmetric:
        z = torch.full_like(z, 8)
    layer = QuantLinear(CTPackedInt4Method(group_size=G, symmetric=symmetric), "m", K, N, False)
    tensors = {"weight_packed": pack_to_int32((q - 8).to(torch.int8), 4),
               "weight_scale": s.bfloat16().float().to(torch.bfloat16),
               "weight_shape": torch.tensor([N, K])}
    if not symmetric:
        tensors["weight_zero_point"] = pack_to_int32((z - 8).to(torch.int8), 4, packed_dim=0)
    fill(layer, tensors)
    check(layer, grouped_weight(q, z, s.bfloat16().float(), torch.arange(K) // G))


def test_compressed_tensors_pack_quantized_act_order():
    """actorder "group": weight_g_idx gives each input channel's group (groups scattered over K). The
    torch path and dequantized_weight follow it; int4_codes gives the codes sorted by group with the
    order, which int4_experts packs back to the same weight."""
    from dsquant.runtime.kernels.moe.fused_moe_int4 import dequantize_int4_experts, int4_experts

    q, z, s = codes(6)
    g_idx = torch.empty(K, dtype=torch.long)
    g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(7))] = torch.arange(K) // G
    stored = {"weight_packed": pack_to_int32((q - 8).to(torch.int8), 4), "weight_scale": s.bfloat16(),
              "weight_zero_point": pack_to_int32((z - 8).to(torch.int8), 4, packed_dim=0),
              "weight_shape": torch.tensor([N, K]), "weight_g_idx": g_idx.to(torch.int32)}
    layer = QuantLinear(CTPackedInt4Method(group_size=G, symmetric=False, g_idx=True), "m", K, N, False)
    fill(layer, stored)
    w_ref = grouped_weight(q, z, s.bfloat16().float(), g_idx)
    check(layer, w_ref)
    layer = QuantLinear(CTPackedInt4Method(group_size=G, symmetric=False, g_idx=True), "m", K, N, False)
    for name, t in stored.items():  # loaded, not processed: the packed tensors stay for int4_codes
        layer._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
    cq, cz, cs, perm = layer.method.int4_codes(layer)
    assert torch.equal(g_idx[perm], torch.arange(K) // G) and torch.equal(cq, q[:, perm].to(cq.dtype))
    packed = int4_experts(cq[None].to(torch.uint8), cz[None], cs[None], G, perm=perm[None])
    torch.testing.assert_close(dequantize_int4_experts(packed)[0], w_ref, rtol=0, atol=0)


@pytest.mark.gpu
def test_compressed_tensors_act_order_kernel_path_gpu():
    """actorder "group" on the W4A16 kernels (the activations gathered through the order) equals x @ W^T."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, z, s = codes(8)
    n, k = N, K
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(9))] = torch.arange(k) // G
    layer = QuantLinear(CTPackedInt4Method(group_size=G, symmetric=False, g_idx=True), "m", k, n, False)
    tensors = {"weight_packed": pack_to_int32((q - 8).to(torch.int8), 4), "weight_scale": s.bfloat16(),
               "weight_zero_point": pack_to_int32((z - 8).to(torch.int8), 4, packed_dim=0),
               "weight_shape": torch.tensor([n, k]), "weight_g_idx": g_idx.to(torch.int32)}
    for name, t in tensors.items():
        layer._parameters[name] = torch.nn.Parameter(t.cuda(), requires_grad=False)
    layer.compute_dtype = torch.bfloat16
    layer.method.process_weights_after_loading(layer)
    assert layer.w4.perm is not None
    w_ref = grouped_weight(q, z, s.bfloat16().float(), g_idx)
    for m in (1, 2, 16, 64):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        ref = x.float().cpu() @ w_ref.t()
        torch.testing.assert_close(layer(x).float().cpu(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


@pytest.mark.parametrize("strategy", ["block", "channel", "tensor"])
def test_compressed_tensors_float_quantized(strategy):
    w = torch.randn(N, K)
    layer = QuantLinear(CTFloat8Method(strategy=strategy), "m", K, N, False)
    if strategy == "block":
        fp8, scale = quantize_fp8_block(w)
        w_ref = fp8.float() * scale.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    else:
        amax = w.abs().amax(1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
        scale = amax / 448
        fp8 = (w / scale.reshape(-1, 1)).to(torch.float8_e4m3fn)
        w_ref = fp8.float() * scale.reshape(-1, 1)
    fill(layer, {"weight": fp8, "weight_scale": scale})
    check(layer, w_ref)


def test_dense():
    w = torch.randn(N, K)
    layer = QuantLinear(DenseMethod(), "m", K, N, False)
    fill(layer, {"weight": w})
    check(layer, w)


class FakeReader:
    def __init__(self, keys):
        self.keys = set(keys)

    def __contains__(self, key):
        return key in self.keys


def test_factory_picks_methods_from_quantization_config():
    awq = LinearFactory({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm",
                         "modules_to_not_convert": ["self_attn.kv_b_proj"]})
    assert awq.scheme_for("model.layers.0.mlp.down_proj").name == "awq"
    assert awq.scheme_for("model.layers.0.mlp.down_proj").group_size == 64
    assert awq.scheme_for("model.layers.3.self_attn.kv_b_proj").name == "dense"
    assert awq.scheme_for("lm_head").name == "dense"
    ct = LinearFactory({"quant_method": "compressed-tensors", "ignore": ["lm_head", "model.layers.0.mlp.down_proj"],
                        "config_groups": {
                            "g0": {"targets": [r"re:^model\.layers\.\d+\.self_attn\..*$"], "format": "float-quantized",
                                   "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                               "block_structure": [128, 128]}},
                            "g1": {"targets": ["Linear"], "format": "pack-quantized",
                                   "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                                               "symmetric": False}}}})
    assert ct.scheme_for("model.layers.1.self_attn.q_proj").name == "ct_fp8"
    assert ct.scheme_for("model.layers.1.mlp.experts.3.up_proj").name == "ct_int4"
    assert ct.scheme_for("model.layers.0.mlp.down_proj").name == "dense"
    assert ct.scheme_for("lm_head").name == "dense"
    # native DeepSeek-V3 FP8: modules without weight_scale_inv in the checkpoint load dense
    fp8 = LinearFactory({"quant_method": "fp8", "weight_block_size": [128, 128]},
                        FakeReader({"model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale_inv",
                                    "model.layers.0.mlp.gate_proj.weight"}))
    assert fp8("model.layers.0.mlp.up_proj", 64, 64, False).method.name == "fp8_block"
    assert fp8("model.layers.0.mlp.gate_proj", 64, 64, False).method.name == "dense"


def test_factory_refuses_unknown_schemes():
    from dsquant.errors import ConfigError

    for q in ({"quant_method": "bitsandbytes"}, {"quant_method": "awq", "bits": 3},
              {"quant_method": "awq", "version": "gemv"}, {"quant_method": "fp8", "weight_block_size": [64, 64]},
              {"quant_method": "fp8", "activation_scheme": "static"}):
        with pytest.raises(ConfigError):
            LinearFactory(q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", [FP8BlockMethod, lambda: CTFloat8Method(strategy="block", dynamic_activations=True)])
def test_fp8_layer_keeps_one_zero_counter_buffer_gpu(method):
    """The FP8 layer owns its split-K counters (no torch.zeros, i.e. no memset node, per call):
    every decode / split-K launch leaves them zero and the product equals the W8A8 reference."""
    n, k = 2048, 1536  # K / 128 = 12 blocks; decode takes the GEMV, split-K on some configs
    w = torch.randn(n, k) * torch.logspace(-2, 1, n).unsqueeze(1)  # row scales over 3 decades
    fp8, scale_inv = quantize_fp8_block(w)
    layer = QuantLinear(method(), "m", k, n, False)
    names = ("weight", "weight_scale_inv") if isinstance(layer.method, FP8BlockMethod) else \
        ("weight", "weight_scale")
    for name, t in zip(names, (fp8, scale_inv)):
        layer._parameters[name] = torch.nn.Parameter(t.cuda(), requires_grad=False)
    layer.compute_dtype = torch.bfloat16
    layer.method.process_weights_after_loading(layer)
    counters = layer.splitk_counters
    per_elem = scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    for m in (1, 2, 4, 16, 64):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        xq, xs = quantize_fp8_activations(x.float().cpu())
        ref = (xq.float() * xs.repeat_interleave(128, 1)[:, :k]) @ (fp8.float() * per_elem).t()
        y = layer(x)
        torch.cuda.synchronize()
        assert layer.splitk_counters is counters and int(counters.abs().sum()) == 0, m
        torch.testing.assert_close(y.float().cpu(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq-v2", "ct-asym", "ct-sym"])
def test_int4_codes_rebuild_the_weight(fmt):
    """int4_codes, what the fused MoE stacks every INT4 source's experts from, decodes to the weight the
    format encodes, and int4_experts packs those codes into the grouped GEMM's layout losslessly
    (GPTQ v1's zero point 16 included)."""
    from dsquant.runtime.kernels.moe.fused_moe_int4 import dequantize_int4_experts, int4_experts

    q, z, s = codes(3)
    if fmt == "gptq":
        z[0, 0] = 16  # v1 stores z - 1: 16 is its largest zero point
    if fmt == "ct-sym":
        z = torch.full_like(z, 8)
    if fmt == "awq":
        layer = QuantLinear(AWQMethod(group_size=G), "m", K, N, False)
        tensors = {"qweight": pack_awq(q.t()), "qzeros": pack_awq(z.t()), "scales": s.t().contiguous().half()}
    elif fmt.startswith("gptq"):
        v2 = fmt == "gptq-v2"
        layer = QuantLinear(GPTQMethod(group_size=G, v2=v2), "m", K, N, False)
        tensors = {"qweight": pack_gptq_qweight(q.t()), "qzeros": pack_gptq_qzeros(z.t(), v2=v2),
                   "scales": s.t().contiguous().half(), "g_idx": (torch.arange(K) // G).to(torch.int32)}
    else:
        s = s.bfloat16().float()  # compressed-tensors stores the model's bf16 scales
        symmetric = fmt == "ct-sym"
        layer = QuantLinear(CTPackedInt4Method(group_size=G, symmetric=symmetric), "m", K, N, False)
        tensors = {"weight_packed": pack_to_int32((q - 8).to(torch.int8), 4), "weight_scale": s.bfloat16(),
                   "weight_shape": torch.tensor([N, K])}
        if not symmetric:
            tensors["weight_zero_point"] = pack_to_int32((z - 8).to(torch.int8), 4, packed_dim=0)
    fill(layer, tensors)
    cq, cz, cs, perm = layer.method.int4_codes(layer)  # [N, K], [K/G, N], [K/G, N], None
    assert cq.shape == (N, K) and cz.shape == cs.shape == (K // G, N) and perm is None
    w_ref = grouped_weight(q, z, s, torch.arange(K) // G)
    g = torch.arange(K) // G
    torch.testing.assert_close((cq - cz.t()[:, g]).float() * cs.float().t()[:, g], w_ref, rtol=0, atol=0)
    packed = int4_experts(cq[None].to(torch.uint8), cz[None], cs[None], G)
    torch.testing.assert_close(dequantize_int4_experts(packed)[0], w_ref, rtol=0, atol=0)


def test_act_order_gptq_int4_codes_come_sorted_by_group():
    """Act-order g_idx: int4_codes gives the codes with their columns sorted by group and the order
    (perm), and int4_experts built from them dequantizes back to the layer's own weight; groups of
    uneven size are refused."""
    from dsquant.runtime.kernels.moe.fused_moe_int4 import dequantize_int4_experts, int4_experts

    q, z, s = codes(4)
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(5))] = (torch.arange(K) // G).to(torch.int32)
    layer = QuantLinear(GPTQMethod(group_size=G), "m", K, N, False)
    tensors = {"qweight": pack_gptq_qweight(q.t()), "qzeros": pack_gptq_qzeros(z.t()),
               "scales": s.t().contiguous().half(), "g_idx": g_idx}
    fill(layer, tensors)
    cq, cz, cs, perm = layer.method.int4_codes(layer)
    assert perm is not None and torch.equal(g_idx[perm].long(), torch.arange(K) // G)
    assert torch.equal(cq, q[:, perm].to(cq.dtype))
    packed = int4_experts(cq[None].to(torch.uint8), cz[None], cs[None], G, perm=perm[None])
    w_ref = layer.method.dequantized_weight(layer, torch.float32)  # [N, K] through g_idx
    torch.testing.assert_close(dequantize_int4_experts(packed)[0], w_ref, rtol=0, atol=0)
    uneven = QuantLinear(GPTQMethod(group_size=G), "m", K, N, False)
    fill(uneven, {**tensors, "g_idx": torch.where(g_idx == 1, 0, g_idx)})
    with pytest.raises(ValueError, match="exactly group_size"):
        uneven.method.int4_codes(uneven)
