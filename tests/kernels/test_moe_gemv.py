"""INT4 expert GEMV (decode-sized MoE) against a float64 loop over experts, and against the grouped path."""
import pytest
import torch

from dsquant.runtime.kernels.fused_moe import fused_moe, pick_configs
from dsquant.runtime.kernels.moe_gemv import MOE_GEMV_MAX_PAIRS, moe_gemv_int4
from dsquant.runtime.kernels.reference_moe import moe_experts_reference
from tests.kernels.moe_cases import make_experts, make_projection, random_topk, rel_err


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("block_n,warps", [(16, 2), (256, 4)])
def test_moe_gemv_projection_matches_dense(group, block_n, warps, device):
    """Routed (down-style) GEMV: out[p] = w_p * a[p] @ W_e^T; N = 384 leaves a partial 256 block."""
    e, n, k, t, top_k = 5, 384, 256, 3, 2
    g, dense = make_projection(f"int4-g{group}", torch.randn(e, n, k, device=device) / k ** 0.5, torch.float16)
    tw, ids = random_topk(t, e, top_k, device)
    a = torch.randn(t * top_k, k, dtype=torch.float16, device=device)
    out = torch.full((t * top_k, n), float("nan"), dtype=torch.float16, device=device)
    moe_gemv_int4(a, g, ids, out, a_row_div=1, gated=False, topk_weights=tw, block_n=block_n,
                  num_warps=warps)
    ref = torch.stack([tw.reshape(-1)[p].double() * (a[p].double() @ dense[ids.reshape(-1)[p]].t())
                       for p in range(t * top_k)])
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.to(out.device)) < 4e-3


@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g64", "int4-g128"])
@pytest.mark.parametrize("t,k", [(1, 6), (4, 4), (2, 3)])
def test_fused_moe_gemv_path_matches_reference_and_grouped(fmt, t, k, device):
    assert t * k <= MOE_GEMV_MAX_PAIRS  # these take the GEMV path
    weights, d13, d2 = make_experts(fmt, 8, 256, 128, torch.float16, device)
    hidden = torch.randn(t, 256, dtype=torch.float16, device=device)
    tw, ids = random_topk(t, 8, k, device)
    shared = torch.randn(t, 256, dtype=torch.float16, device=device)
    out = fused_moe(hidden, weights, tw, ids, shared_output=shared)
    ref = moe_experts_reference(hidden, d13, d2, tw, ids) + shared.double()
    assert torch.isfinite(out).all() and rel_err(out, ref) < 4e-3
    grouped = fused_moe(hidden, weights, tw, ids, shared_output=shared,
                        configs=pick_configs(t * k, 8, "int4", weights.w13.group_size, 128, 256))
    assert rel_err(out, grouped.double()) < 4e-3


def test_moe_gemv_rejects_bad_shapes(device):
    g, _ = make_projection("int4-g128", torch.randn(2, 128, 128, device=device), torch.float16)
    ids = torch.zeros(1, 2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="out"):
        moe_gemv_int4(torch.randn(2, 128, dtype=torch.float16, device=device), g, ids,
                      torch.empty(2, 64, dtype=torch.float16, device=device), 1, False)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k", [(1, 6), (2, 8)])
def test_moe_gemv_v2_lite_layer_bf16(t, k):
    """V2-Lite expert shapes (64 experts, H 2048, I 1408) in bf16: GEMV path vs float64 loop."""
    weights, d13, d2 = make_experts("int4-g128", 64, 2048, 1408, torch.bfloat16, "cuda")
    hidden = torch.randn(t, 2048, dtype=torch.bfloat16, device="cuda")
    tw, ids = random_topk(t, 64, k, "cuda")
    out = fused_moe(hidden, weights, tw, ids)
    assert torch.isfinite(out).all()
    assert rel_err(out, moe_experts_reference(hidden, d13, d2, tw, ids)) < 2e-2
