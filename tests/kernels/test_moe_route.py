"""The one-launch routing kernel (runtime/kernels/moe/moe_route.py) against models/routing.select_experts:
the same experts per token (as a set) and the same weights within fp32 rounding, for every scoring,
top-k method, norm_topk_prob and scaling factor; outputs are poisoned before the launch."""
import pytest
import torch

from dsquant.models.routing import RoutingConfig, select_experts
from dsquant.runtime.kernels.moe.moe_route import moe_route

# (E, top_k, n_group, topk_group): tiny, V2-Lite, V2 (160 experts), V3 (256 experts)
SHAPES = [(8, 2, 2, 1), (64, 6, 8, 3), (160, 6, 8, 3), (256, 8, 8, 4)]
METHODS = [("softmax", "greedy"), ("softmax", "group_limited_greedy"), ("sigmoid", "noaux_tc"),
           ("sigmoid", "greedy"), ("sigmoid", "group_limited_greedy")]


def _check(t, e, k, n_group, topk_group, scoring, method, norm, scale, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, e, generator=g) * 2).to(device)  # [T, E] fp32
    bias = (torch.randn(e, generator=g) * 0.5).to(device) if method == "noaux_tc" else None
    cfg = RoutingConfig(e, k, scoring, method, n_group, topk_group, norm, scale)
    ref_w, ref_ids = select_experts(logits, cfg, bias)
    out = (torch.full((t, k), float("nan"), device=device), torch.full((t, k), -7, dtype=torch.int32, device=device))
    w, ids = moe_route(logits, k, scoring, method, n_group, topk_group, norm, scale, bias, out=out)
    assert w.data_ptr() == out[0].data_ptr() and ids.dtype == torch.int32
    assert torch.isfinite(w).all()
    order, ref_order = ids.long().argsort(dim=-1), ref_ids.argsort(dim=-1)
    assert torch.equal(ids.long().gather(1, order), ref_ids.gather(1, ref_order)), "different experts chosen"
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), rtol=2e-6, atol=1e-7)
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.full_like(w[:, 0], scale))


@pytest.mark.parametrize("scoring,method", METHODS)
@pytest.mark.parametrize("e,k,n_group,topk_group", SHAPES)
@pytest.mark.parametrize("t", [1, 5])
def test_route_matches_select_experts(t, e, k, n_group, topk_group, scoring, method, device):
    _check(t, e, k, n_group, topk_group, scoring, method, method == "noaux_tc", 2.5, device)


@pytest.mark.parametrize("norm,scale", [(True, 1.0), (False, 1.0), (True, 16.0), (False, 0.5)])
@pytest.mark.parametrize("scoring,method", METHODS[:3])
def test_route_norm_and_scaling(norm, scale, scoring, method, device):
    _check(3, 64, 6, 8, 3, scoring, method, norm, scale, device, seed=1)


@pytest.mark.parametrize("scoring,method", METHODS[:3])
def test_route_64_tokens(scoring, method, device):
    _check(64, 160, 6, 8, 3, scoring, method, True, 2.5, device, seed=2)


@pytest.mark.gpu
@pytest.mark.parametrize("scoring,method", METHODS)
@pytest.mark.parametrize("e,k,n_group,topk_group", SHAPES)
@pytest.mark.parametrize("t", [1, 5, 64, 4096])
@pytest.mark.parametrize("norm", [False, True])
def test_route_full_size(t, e, k, n_group, topk_group, scoring, method, norm, device):
    _check(t, e, k, n_group, topk_group, scoring, method, norm, 2.5, device, seed=3)


def test_route_strided_logits(device):
    """A row-strided view (logits as a slice of a wider GEMM output) is read in place."""
    wide = torch.randn(4, 80, device=device)
    cfg = RoutingConfig(64, 6, "softmax", "greedy")
    ref_w, ref_ids = select_experts(wide[:, :64], cfg)
    w, ids = moe_route(wide[:, :64], 6)
    assert torch.equal(ids.long().sort(-1)[0], ref_ids.sort(-1)[0])


def test_route_rejects_bad_input(device):
    logits = torch.randn(2, 16, device=device)
    with pytest.raises(ValueError, match="logits must be fp32"):
        moe_route(logits.half(), 2)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        moe_route(logits, 2, "sigmoid", "noaux_tc", 4, 2)
    with pytest.raises(ValueError, match="n_group"):
        moe_route(logits, 2, "softmax", "group_limited_greedy", 3, 2)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, 9, "softmax", "group_limited_greedy", 4, 2)
    with pytest.raises(ValueError, match="scoring"):
        moe_route(logits, 2, "relu")
    with pytest.raises(ValueError, match="out must be"):
        moe_route(logits, 2, out=(torch.empty(2, 2, device=device), torch.empty(2, 2, dtype=torch.int64, device=device)))


@pytest.mark.parametrize("n_shared", [1, 2, 3])
@pytest.mark.parametrize("scoring,method", METHODS[:3])
def test_route_appends_shared_experts(n_shared, scoring, method, device):
    """n_shared columns after the top-k: ids E .. E + n_shared - 1, weight 1 (what
    fused_moe.with_shared_experts appends), the routed columns as without them."""
    e, k, t = 64, 6, 5
    logits = torch.randn(t, e, device=device) * 2
    bias = torch.randn(e, device=device) * 0.5 if method == "noaux_tc" else None
    args = (k, scoring, method, 8, 3, True, 2.5, bias)
    out = (torch.full((t, k + n_shared), float("nan"), device=device),
           torch.full((t, k + n_shared), -7, dtype=torch.int32, device=device))
    w, ids = moe_route(logits, *args, out=out, n_shared=n_shared)
    ref_w, ref_ids = moe_route(logits, *args)
    assert torch.equal(ids[:, :k], ref_ids) and torch.equal(w[:, :k], ref_w)
    assert torch.equal(ids[:, k:], torch.arange(e, e + n_shared, dtype=torch.int32, device=device).expand(t, -1))
    assert torch.equal(w[:, k:], torch.ones(t, n_shared, device=device))
