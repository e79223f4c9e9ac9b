"""MoE routing against transformers 5.17's DeepseekV2TopkRouter / DeepseekV3TopkRouter."""
import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from dsquant.models.routing import RoutingConfig, route


def _sorted(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _assert_same(ours, theirs):
    (w, i), (hw, hi) = _sorted(*ours), _sorted(*theirs)
    assert torch.equal(i.long(), hi.long()), "different experts chosen"
    torch.testing.assert_close(w, hw.float(), rtol=1e-6, atol=1e-7)


def _v2(method, t, e, k, n_group, topk_group, device):
    config = DeepseekV2Config(hidden_size=64, n_routed_experts=e, num_experts_per_tok=k, n_group=n_group,
                              topk_group=topk_group, topk_method=method, routed_scaling_factor=2.5)
    router = DeepseekV2TopkRouter(config).to(device)
    router.weight.data.normal_()
    hidden = torch.randn(t, 64, device=device)
    cfg = RoutingConfig(e, k, "softmax", method, n_group, topk_group, False, 2.5)
    return router, hidden, cfg


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
@pytest.mark.parametrize("t", [1, 13])
def test_v2_routing_matches_hf(method, t, device):
    router, hidden, cfg = _v2(method, t, 16, 4, 4, 2, device)
    _, hw, hi = router(hidden)
    _assert_same(route(hidden, router.weight, cfg), (hw, hi))
    assert len(set((route(hidden, router.weight, cfg)[1] // 4)[0].tolist())) <= (2 if method != "greedy" else 4)


def test_v2_norm_topk_prob_is_honoured(device):
    router, hidden, cfg = _v2("group_limited_greedy", 9, 16, 4, 4, 2, device)
    _, hw, hi = router(hidden)
    normed = RoutingConfig(16, 4, "softmax", "group_limited_greedy", 4, 2, True, 2.5)
    w, i = route(hidden, router.weight, normed)
    hw = hw / 2.5
    _assert_same((w, i), (hw / (hw.sum(-1, keepdim=True) + 1e-20) * 2.5, hi))
    torch.testing.assert_close(w.sum(-1), torch.full_like(w[:, 0], 2.5))


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("t,e,k,n_group,topk_group", [(1, 16, 4, 4, 2), (17, 32, 8, 8, 4), (5, 16, 4, 4, 4)])
def test_v3_noaux_tc_matches_hf(t, e, k, n_group, topk_group, norm, device):
    config = DeepseekV3Config(hidden_size=64, n_routed_experts=e, num_experts_per_tok=k, n_group=n_group,
                              topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config).to(device)
    router.weight.data.normal_()
    router.e_score_correction_bias.copy_(torch.randn(e, device=device) * 0.5)
    hidden = torch.randn(t, 64, device=device)
    _, hw, hi = router(hidden)
    cfg = RoutingConfig(e, k, "sigmoid", "noaux_tc", n_group, topk_group, norm, 2.5)
    _assert_same(route(hidden, router.weight, cfg, router.e_score_correction_bias), (hw, hi))


def test_noaux_tc_bias_steers_choice_but_not_weights(device):
    """A huge bias on expert 3 forces it in; its weight is still its unbiased sigmoid score."""
    cfg = RoutingConfig(8, 2, "sigmoid", "noaux_tc", 2, 1, False, 1.0)
    hidden, gate = torch.randn(4, 16, device=device), torch.randn(8, 16, device=device)
    bias = torch.zeros(8, device=device)
    bias[3] = 100.0
    w, i = route(hidden, gate, cfg, bias)
    assert (i == 3).any(dim=-1).all()
    scores = (hidden @ gate.t()).sigmoid()
    torch.testing.assert_close(w, scores.gather(1, i))


def test_one_token_routed_to_every_group(device):
    """topk_group = n_group and a token whose best expert in each group wins: one per group."""
    cfg = RoutingConfig(16, 4, "softmax", "group_limited_greedy", 4, 4, False, 1.0)
    logits_hidden = torch.eye(16, device=device)[[1, 6, 11, 12]].sum(0, keepdim=True) * 5  # [1, 16]
    w, i = route(logits_hidden, torch.eye(16, device=device), cfg)
    assert sorted((i // 4).tolist()[0]) == [0, 1, 2, 3]
    assert sorted(i.tolist()[0]) == [1, 6, 11, 12]


def test_routing_config_names_bad_fields():
    with pytest.raises(ValueError, match="topk_method"):
        RoutingConfig(8, 2, topk_method="sparse")
    with pytest.raises(ValueError, match="n_group"):
        RoutingConfig(10, 2, topk_method="group_limited_greedy", n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        route(torch.randn(2, 4), torch.randn(8, 4), RoutingConfig(8, 2, "sigmoid", "noaux_tc", 2, 1))
