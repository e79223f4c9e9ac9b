"""L2 prefetch of the next launch's expert weights (runtime/kernels/l2_prefetch.py).

CPU: which launches prefetch and how much (the budget rule), and that nothing prefetches on the CPU
or under the interpreter. The placement of the bulk prefetches in the sm_90 SASS (after the PDL wait,
since they follow the routed ids) is checked in tests/kernels/test_pdl.py. GPU: the V2-Lite MoE layer
routed and run with the prefetch on gives the same ids, weights and outputs bit for bit as with it off
(a prefetch changes where bytes are found, never a value), for BF16, INT4 and FP8 experts."""
import pytest
import torch

from dsquant.runtime.kernels import l2_prefetch
from dsquant.runtime.kernels.moe.moe_gemm import GroupedWeight
from tests.kernels.moe_cases import V2_LITE, hidden_states, v2_lite_experts


def _int4_weight(e: int, n: int, k: int, group: int = 128) -> GroupedWeight:
    """An INT4 GroupedWeight's tensors at the given shape (values unused: the rule reads only bytes)."""
    return GroupedWeight("int4", torch.zeros(e, n // 16, k // 128, 16, 16, dtype=torch.int32),
                         torch.zeros(e, k // group, n, dtype=torch.bfloat16),
                         torch.zeros(e, k // group, n, dtype=torch.uint8), group, n, k)


def test_expert_regions_bytes_and_budget():
    w = _int4_weight(4, 2816, 2048)  # V2-Lite gate/up: 2.88 MB codes, 90 KB scales, 45 KB zeros an expert
    per = (2816 * 2048 // 2, 16 * 2816 * 2, 16 * 2816)
    r = l2_prefetch.expert_regions(w, 1, 28 << 20)
    assert r.nbytes == per and r.tensors == (w.weight, w.scales, w.zeros)
    assert r.count == (28 << 20) // sum(per) == 9  # one token: every one of its 8 experts fits
    assert l2_prefetch.expert_regions(w, 2, 28 << 20).count == 4  # two tokens share the budget
    assert l2_prefetch.expert_regions(w, 10, 28 << 20) is None  # not one expert each
    assert l2_prefetch.expert_regions(w, 0, 28 << 20) is None
    bf16 = GroupedWeight("bf16", torch.zeros(4, 256, 128, dtype=torch.bfloat16), n=256, k=128)
    r = l2_prefetch.expert_regions(bf16, 1, 1 << 20)
    assert r.nbytes == (256 * 128 * 2, 0, 0) and r.tensors == (bf16.weight,) * 3  # unused slots: 0 bytes
    strided = GroupedWeight("bf16", torch.zeros(4, 128, 256, dtype=torch.bfloat16).transpose(1, 2), n=256, k=128)
    assert l2_prefetch.expert_regions(strided, 1, 1 << 20) is None  # an expert is not one run of bytes


def test_no_prefetch_off_the_gpu(monkeypatch):
    w = _int4_weight(4, 256, 256)
    monkeypatch.setattr(l2_prefetch, "ENABLED", True)
    assert not l2_prefetch.available(torch.device("cpu"))
    assert l2_prefetch.route_kwargs(w, 1, 8, torch.device("cpu")) == {}
    assert l2_prefetch.share_kwargs(w, 8, torch.device("cpu")) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not l2_prefetch.available(torch.device("cuda", 0))  # the interpreter runs no inline PTX
    monkeypatch.setattr(l2_prefetch, "ENABLED", False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not l2_prefetch.available(torch.device("cuda", 0))


def test_kwargs_follow_the_budget(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "available", lambda device: True)
    w13, w2 = _int4_weight(66, 2816, 2048), _int4_weight(66, 2048, 1408)
    route = l2_prefetch.route_kwargs(w13, 1, 8, torch.device("cuda", 0))
    assert route["PF_COUNT"] == 8 and route["pf_w"] is w13.weight and route["PF_PIECES"] == l2_prefetch.ROUTE_PIECES
    assert l2_prefetch.route_kwargs(w13, 64, 8, torch.device("cuda", 0)) == {}  # 64 tokens: none fits
    share = l2_prefetch.share_kwargs(w2, 8, torch.device("cuda", 0))
    assert share["PF"] and share["pf_wb"] == 2048 * 1408 // 2
    assert l2_prefetch.share_kwargs(w2, 512, torch.device("cuda", 0)) == {}  # a 64-token step's pairs


def _layer(fmt: str, t: int, enabled: bool, monkeypatch):
    """Route t tokens through moe_route (with the gate/up prefetch) and run fused_moe on V2-Lite experts."""
    from dsquant.runtime.kernels.moe.fused_moe import fused_moe
    from dsquant.runtime.kernels.moe.moe_route import moe_route

    monkeypatch.setattr(l2_prefetch, "ENABLED", enabled)
    weights, _, _ = v2_lite_experts(fmt)
    gen = torch.Generator(device="cuda").manual_seed(t)
    logits = torch.randn(t, 64, generator=gen, device="cuda")
    hidden = hidden_states(t, V2_LITE["hidden"], torch.bfloat16, "cuda", seed=t)
    tw, ids = moe_route(logits, 6, n_shared=2, prefetch=weights.w13)
    return tw, ids, fused_moe(hidden, weights, tw, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("fmt", ["int4-g128", "fp8", "bf16"])
def test_v2_lite_layer_bitwise_with_prefetch(fmt, t, monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cp.async.bulk.prefetch needs sm_90")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    off = _layer(fmt, t, False, monkeypatch)
    on = _layer(fmt, t, True, monkeypatch)
    assert l2_prefetch.available(torch.device("cuda"))
    for a, b in zip(off, on):
        assert torch.equal(a, b), fmt
