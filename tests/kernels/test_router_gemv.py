"""router_logits (decode router GEMV, fp32 out) against linear(x.float(), weight.float()) on fresh
random inputs, output poisoned; the top-k it implies equals the reference's."""
import pytest
import torch

from dsquant.runtime.kernels.moe import router_gemv
from dsquant.runtime.kernels.moe.router_gemv import router_logits


def _check(device, dtype, t, experts, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(device, dtype)
    w = (torch.randn(experts, hidden, generator=g) * 0.05).to(device, dtype)
    ref = torch.nn.functional.linear(x.float(), w.float())
    got = router_logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (t, experts)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
    k = min(6, experts)
    assert torch.equal(got.topk(k, -1)[1].sort(-1)[0], ref.topk(k, -1)[1].sort(-1)[0])


@pytest.mark.parametrize("t,experts,hidden", [(1, 8, 64), (3, 7, 96), (5, 66, 256)])
def test_router_logits(device, t, experts, hidden):
    _check(device, torch.float16, t, experts, hidden, seed=t + experts)


def test_router_logits_poisoned_output_fully_written(device, monkeypatch):
    real_empty = torch.empty
    monkeypatch.setattr(router_gemv.torch, "empty",
                        lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    _check(device, torch.float16, 2, 10, 128, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 16])
@pytest.mark.parametrize("experts,hidden", [(64, 2048), (256, 7168)])
def test_router_logits_bf16_deepseek_shapes(t, experts, hidden):
    _check("cuda", torch.bfloat16, t, experts, hidden, seed=t)


# (E, top_k, n_group, topk_group, scoring, method): tiny greedy, V2-Lite-like grouped, V3-like noaux_tc
ROUTES = [(8, 2, 1, 1, "softmax", "greedy"), (64, 6, 8, 3, "softmax", "group_limited_greedy"),
          (256, 8, 8, 4, "sigmoid", "noaux_tc")]


def _route_case(device, dtype, t, e, k, n_group, topk_group, scoring, method, hidden, n_shared, seed,
                norm=True, scale=2.5):
    """router_route into poisoned outputs against router_logits + moe_route (the two launches it fuses:
    the same logits, so the same ids, and the same weights to the bit except softmax weights on a GPU,
    whose denominator sums in another order: within fp32 rounding) and against select_experts on the float32 logits (as sets); the
    counters are left zero, and a second launch gives the same bits."""
    from dsquant.models.routing import RoutingConfig, select_experts
    from dsquant.runtime.kernels.moe.moe_route import moe_route

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(device, dtype)
    w = (torch.randn(e, hidden, generator=g) * 0.05).to(device, dtype)
    bias = (torch.randn(e, generator=g) * 0.5).to(device) if method == "noaux_tc" else None
    args = (k, scoring, method, n_group, topk_group, norm, scale, bias)
    counters = torch.zeros(router_gemv.ROUTER_GEMV_MAX_T, dtype=torch.int32, device=device)
    outs = []
    for _ in range(2):
        out = (torch.full((t, k + n_shared), float("nan"), device=device),
               torch.full((t, k + n_shared), -7, dtype=torch.int32, device=device))
        got = router_gemv.router_route(x, w, counters, *args, n_shared=n_shared, out=out)
        assert got[0].data_ptr() == out[0].data_ptr() and int(counters.abs().sum()) == 0
        outs.append(got)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    weights, ids = outs[0]
    ref_w, ref_ids = moe_route(router_logits(x, w), *args, n_shared=n_shared)
    assert torch.equal(ids, ref_ids)
    if device == "cpu" or scoring == "sigmoid":
        assert torch.equal(weights, ref_w)
    else:  # softmax's denominator sums all E slots, over router_route's 4 warps vs moe_route's 1-2 on a GPU
        torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=0)
    sel_w, sel_ids = select_experts(torch.nn.functional.linear(x.float(), w.float()),
                                    RoutingConfig(e, k, scoring, method, n_group, topk_group, norm, scale), bias)
    assert torch.equal(ids[:, :k].long().sort(-1)[0], sel_ids.sort(-1)[0])


@pytest.mark.parametrize("e,k,n_group,topk_group,scoring,method", ROUTES)
@pytest.mark.parametrize("t,n_shared", [(1, 0), (3, 2)])
def test_router_route_matches_two_launches(device, t, n_shared, e, k, n_group, topk_group, scoring, method):
    _route_case(device, torch.float16, t, e, k, n_group, topk_group, scoring, method, 96, n_shared, seed=t + e)


def test_router_route_rejects_bad_counters(device):
    x, w = torch.randn(2, 64, device=device).half(), torch.randn(8, 64, device=device).half()
    with pytest.raises(ValueError, match="counters"):
        router_gemv.router_route(x, w, torch.zeros(1, dtype=torch.int32, device=device), 2)
    with pytest.raises(ValueError, match="counters"):
        router_gemv.router_route(x, w, torch.zeros(4, dtype=torch.int64, device=device), 2)


@pytest.mark.gpu
@pytest.mark.parametrize("e,k,n_group,topk_group,scoring,method", ROUTES[1:])
@pytest.mark.parametrize("t", [1, 8, 16])
def test_router_route_bf16_deepseek_shapes(t, e, k, n_group, topk_group, scoring, method):
    hidden = 2048 if e == 64 else 7168
    _route_case("cuda", torch.bfloat16, t, e, k, n_group, topk_group, scoring, method, hidden, 2, seed=t)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 8, 16])
def test_router_route_bf16_v2_lite_greedy(t):
    """V2-Lite's own routing (greedy top-6 of 64, softmax weights not renormalized, scale 1): on an H100
    the weights differed from the two launches' in the last bits (ids equal), the softmax sum running
    over 4 warps here and 1 in moe_route."""
    _route_case("cuda", torch.bfloat16, t, 64, 6, 1, 1, "softmax", "greedy", 2048, 2, seed=t, norm=False, scale=1.0)


def test_fused_route_rule():
    """One launch for V2/V3-sized routers at decode sizes; two at V2-Lite's hidden size, where the probe
    timed the fused form slower."""
    assert router_gemv.fused_route_takes(1, 7168) and router_gemv.fused_route_takes(16, 5120)
    assert not router_gemv.fused_route_takes(1, 2048)
    assert not router_gemv.fused_route_takes(router_gemv.FUSED_ROUTE_MAX_T + 1, 7168)
