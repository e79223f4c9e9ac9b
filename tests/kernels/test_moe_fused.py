"""Fused MoE (align + grouped GEMMs + sum) against a float64 loop over experts, every format."""
import functools

import pytest
import torch

from dsquant.runtime.kernels.fused_moe import (fused_moe, pick_configs, split_shared_experts,
                                               with_shared_experts, MoeWeights, bf16_experts)
from dsquant.runtime.kernels.fused_moe_fp8 import quantize_act_fp8, quantize_act_fp8_torch
from dsquant.runtime.kernels.moe_align import moe_align_block_size
from dsquant.runtime.kernels.moe_gemm import GemmConfig, moe_gemm
from dsquant.models.routing import RoutingConfig, route
from dsquant.runtime.kernels.reference_moe import moe_experts_reference
from tests.kernels.moe_cases import FORMATS, make_experts, random_topk, rel_err

E, H, I = 8, 128, 128  # small CPU shapes; fp8 needs I % 128 == 0, int4 g128 needs H % 128 == 0


def _tol(fmt, dtype):
    # fp8: the SiLU-and-mul output is re-quantized to fp8, so a 1-ulp bf16 difference in gate/up
    # (accumulation order) can move an intermediate fp8 code by 1/16. On the H200 at T = 1 the
    # error against the float64 reference ranged 0.002-0.021 over 7 draws; a reference without
    # activation quantization is 0.043 away, so 3e-2 still tells the two apart.
    if fmt == "fp8":
        return 3e-2
    return 2e-2 if dtype == torch.bfloat16 else 4e-3


def _check(fmt, weights, d13, d2, hidden, tw, ids, configs=None, shared=None):
    out = fused_moe(hidden, weights, tw, ids, shared_output=shared, configs=configs)
    assert out.shape == hidden.shape and torch.isfinite(out).all()
    ref = moe_experts_reference(hidden, d13, d2, tw, ids, fp8_acts=fmt == "fp8")
    if shared is not None:
        ref = ref + shared.double()
    err = rel_err(out, ref)
    assert err < _tol(fmt, hidden.dtype), f"{fmt}: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("t,k", [(1, 2), (7, 3), (33, 2)])
def test_fused_moe_matches_reference(fmt, t, k, device):
    weights, d13, d2 = make_experts(fmt, E, H, I, torch.float16, device)
    hidden = torch.randn(t, H, dtype=torch.float16, device=device)
    _check(fmt, weights, d13, d2, hidden, *random_topk(t, E, k, device))


@pytest.mark.parametrize("fmt", ["bf16", "int4-g64", "fp8"])
def test_experts_without_tokens(fmt, device):
    """16 experts, only 3 of them receive pairs: the other blocks must not be computed or written."""
    weights, d13, d2 = make_experts(fmt, 16, H, I, torch.float16, device)
    hidden = torch.randn(9, H, dtype=torch.float16, device=device)
    _check(fmt, weights, d13, d2, hidden, *random_topk(9, 16, 2, device, experts=[3, 7, 15]))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_every_routing_method_end_to_end(method, device):
    weights, d13, d2 = make_experts("int4-g32", 16, H, I, torch.float16, device)
    hidden = torch.randn(11, H, dtype=torch.float16, device=device)
    scoring = "sigmoid" if method == "noaux_tc" else "softmax"
    cfg = RoutingConfig(16, 4, scoring, method, 4, 2, method == "noaux_tc", 2.5)
    tw, ids = route(hidden, torch.randn(16, H, device=device), cfg, torch.randn(16, device=device))
    _check("int4-g32", weights, d13, d2, hidden, tw, ids)


def test_one_token_routed_to_every_group(device):
    weights, d13, d2 = make_experts("bf16", 16, H, I, torch.float16, device)
    hidden = torch.randn(1, H, dtype=torch.float16, device=device)
    ids = torch.tensor([[1, 6, 11, 12]], device=device)  # one expert in each group of 4
    _check("bf16", weights, d13, d2, hidden, torch.rand(1, 4, device=device), ids)


@pytest.mark.parametrize("cfg", [GemmConfig(16, 32, 32, 4, 2), GemmConfig(32, 64, 64, 4, 3),
                                 GemmConfig(64, 16, 128, 4, 2)])
def test_ragged_dims_and_block_sizes(cfg, device):
    """bf16 with H and I that no block divides: partial n and k tiles at every edge."""
    weights, d13, d2 = make_experts("bf16", 6, 96, 40, torch.float16, device)
    hidden = torch.randn(13, 96, dtype=torch.float16, device=device)
    _check("bf16", weights, d13, d2, hidden, *random_topk(13, 6, 2, device), configs=(cfg, cfg))


def test_shared_experts_both_ways(device):
    """2 shared experts as a passed-in output and as extra always-selected experts agree."""
    weights, d13, d2 = make_experts("bf16", E, H, I, torch.float16, device)
    gate_up = (torch.randn(2 * 2 * I, H, device=device) / H ** 0.5).half()  # shared MLP, inter 2I
    down = (torch.randn(H, 2 * I, device=device) / (2 * I) ** 0.5).half()
    hidden = torch.randn(5, H, dtype=torch.float16, device=device)
    g, u = (hidden.double() @ gate_up.double().t()).chunk(2, -1)
    shared = ((torch.nn.functional.silu(g) * u) @ down.double().t())  # float64 [T, H]
    tw, ids = random_topk(5, E, 2, device)
    _check("bf16", weights, d13, d2, hidden, tw, ids, shared=shared.half())
    s13, s2 = split_shared_experts(gate_up, down, 2)
    both = MoeWeights(bf16_experts(torch.cat([weights.w13.weight, s13])),
                      bf16_experts(torch.cat([weights.w2.weight, s2])))
    out = fused_moe(hidden, both, *with_shared_experts(tw, ids, E, 2), n_shared=2)
    err = rel_err(out, moe_experts_reference(hidden, d13, d2, tw, ids) + shared)
    assert torch.isfinite(out).all() and err < 4e-3, f"relative error {err:.2e}"


@pytest.mark.parametrize("fmt", ["bf16", "int4-g128", "fp8"])
@pytest.mark.parametrize("t", [1, 9])
def test_residual_and_shared_output_added_in_the_sum(fmt, t, device):
    """fused_moe(..., shared_output, residual) = residual + (experts + shared_output), the adds
    done by the sum launch (T = 1 takes the INT4 GEMV path, T = 9 the grouped GEMMs)."""
    weights, d13, d2 = make_experts(fmt, E, H, I, torch.float16, device)
    hidden = torch.randn(t, H, dtype=torch.float16, device=device)
    shared, residual = torch.randn(2, t, H, dtype=torch.float16, device=device)
    tw, ids = random_topk(t, E, 2, device)
    plain = fused_moe(hidden, weights, tw, ids)
    out = fused_moe(hidden, weights, tw, ids, shared_output=shared, residual=residual)
    torch.testing.assert_close(out, residual + (plain + shared))
    err = rel_err(out - residual, moe_experts_reference(hidden, d13, d2, tw, ids, fp8_acts=fmt == "fp8")
                  + shared.double())
    assert err < _tol(fmt, hidden.dtype), f"{fmt}: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_gemm_writes_every_pair_row(fmt, device):
    """Poisoned outputs: both GEMMs must write every (token, expert) row and no other."""
    weights, _, _ = make_experts(fmt, E, H, I, torch.float16, device)
    t, k = 6, 3
    tw, ids = random_topk(t, E, k, device)
    cfg, _ = pick_configs(t * k, E, fmt.split("-g")[0], weights.w13.group_size)
    align = moe_align_block_size(ids, E, cfg.block_m)
    hidden = torch.randn(t, H, dtype=torch.float16, device=device)
    a, a_s = hidden, None
    if fmt == "fp8":
        a, a_s = quantize_act_fp8(hidden)
    act = torch.full((t * k + 1, I), float("nan"), dtype=torch.float16, device=device)
    moe_gemm(a, weights.w13, align, act, cfg, a_row_div=k, gated=True, a_scale=a_s,
             fp8_upcast=device == "cpu")
    assert torch.isfinite(act[:-1]).all() and torch.isnan(act[-1]).all()
    act = act[:-1]
    if fmt == "fp8":
        act, a_s = quantize_act_fp8(act)
    out = torch.full((t * k + 1, H), float("nan"), dtype=torch.float16, device=device)
    moe_gemm(act, weights.w2, align, out, cfg, a_row_div=1, gated=False, topk_weights=tw,
             a_scale=a_s, fp8_upcast=device == "cpu")
    assert torch.isfinite(out[:-1]).all() and torch.isnan(out[-1]).all()


def test_fused_moe_names_mismatched_hidden(device):
    weights, _, _ = make_experts("bf16", 4, 64, 32, torch.float16, device)
    with pytest.raises(ValueError, match="hidden size"):
        fused_moe(torch.randn(2, 96, dtype=torch.float16, device=device), weights,
                  *random_topk(2, 4, 2, device))


GPU_FORMATS = ["bf16", "int4-g128", "int4-g64", "fp8"]


@functools.lru_cache(maxsize=4)
def _v2_lite_experts(fmt, device):
    return make_experts(fmt, 66, 2048, 1408, torch.bfloat16, device)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GPU_FORMATS)
@pytest.mark.parametrize("t", [1, 8, 517, 4096])
def test_fused_moe_v2_lite_bf16_full_size(fmt, t, device):
    """DeepSeek-V2-Lite layer: 64 experts + 2 shared run as experts, top-6, H 2048, I 1408, bf16."""
    weights, d13, d2 = _v2_lite_experts(fmt, device)
    hidden = torch.randn(t, 2048, dtype=torch.bfloat16, device=device)
    tw, ids = with_shared_experts(*random_topk(t, 64, 6, device), 64, 2)
    _check(fmt, weights, d13, d2, hidden, tw, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 77])
def test_fused_moe_v3_shape_fp8(t, device):
    """DeepSeek-V3 expert shapes (H 7168, I 2048; 32 of its 256 experts, in 8 groups), top-8,
    FP8, noaux_tc routing."""
    weights, d13, d2 = make_experts("fp8", 32, 7168, 2048, torch.bfloat16, device)
    hidden = torch.randn(t, 7168, dtype=torch.bfloat16, device=device)
    cfg = RoutingConfig(32, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5)
    tw, ids = route(hidden, torch.randn(32, 7168, device=device) / 80, cfg,
                    torch.randn(32, device=device) * 0.1)
    _check("fp8", weights, d13, d2, hidden, tw, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 2048), (4096, 1408), (77, 7168)])
def test_act_quant_kernel_matches_torch(shape, device):
    """The in-kernel fp8 cast (GPU only) against torch's: same scales, codes within one step."""
    x = torch.randn(*shape, dtype=torch.bfloat16, device=device) * 3
    q, s = quantize_act_fp8(x)
    q_ref, s_ref = quantize_act_fp8_torch(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    mismatch = (q.float() != q_ref.float()).float().mean()
    assert mismatch < 1e-3, f"{mismatch:.1e} of the fp8 codes differ from torch's rounding"


@pytest.mark.parametrize("group", [32, 128])
def test_int4_repack_keeps_every_weight(group, device):
    """The tiled INT4 layout dequantises to exactly what the AWQ tensors hold, expert by expert."""
    from dsquant import formats
    from dsquant.runtime.kernels.fused_moe_int4 import dequantize_int4_experts, int4_experts_from_awq
    from tests.kernels.moe_cases import _awq

    w = torch.randn(3, 48, 256, device=device)
    qweight, qzeros, scales = _awq(w, group, torch.float16)
    packed = int4_experts_from_awq(qweight, qzeros, scales, group)
    expected = torch.stack([formats.dequantize_awq(qweight[e], qzeros[e], scales[e], group) for e in range(3)])
    assert torch.equal(dequantize_int4_experts(packed), expected)
    with pytest.raises(ValueError, match="in_features % 128"):
        int4_experts_from_awq(*_awq(w[:, :, :192], 64, torch.float16), 64)
