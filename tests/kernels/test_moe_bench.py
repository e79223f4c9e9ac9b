"""The MoE benchmark's two sides compute the same layer: fused_moe on the stacked (and quantized)
weights vs the transformers-style bf16 loop with its shared MLP, on small shapes."""
import pytest
import torch

from dsquant.bench.moe import build_layer, expert_bytes, peer_layer, peer_plan
from dsquant.runtime.kernels.moe.fused_moe import fused_moe, with_shared_experts


@pytest.mark.parametrize("fmt,tol", [("bf16", 4e-3), ("int4", 0.25), ("fp8", 0.08)])
def test_bench_sides_agree(fmt, tol, device):
    e, h, inter, t, k = 8, 128, 128, 5, 3
    rnd = lambda *s: (torch.randn(*s, device=device) / s[-1] ** 0.5).half()  # noqa: E731
    dense = (rnd(e, 2 * inter, h), rnd(e, h, inter), rnd(2 * 2 * inter, h), rnd(h, 2 * inter))
    x = torch.randn(t, h, device=device).half()
    ids = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(t)])
    tw = torch.rand(t, k, device=device)
    ref = peer_layer(x, dense, peer_plan(tw, ids)).double()
    weights = build_layer(fmt, dense, device)
    assert weights.num_experts == e + 2
    out = fused_moe(x, weights, *with_shared_experts(tw, ids, e, 2))
    err = float((out.double() - ref).norm() / ref.norm())
    assert torch.isfinite(out).all() and err < tol, f"{fmt}: relative error {err:.3f}"
    per_expert = expert_bytes(weights)
    dense_bytes = 3 * h * inter * 2
    ratio = {"bf16": 1.0, "int4": (0.5 + 3 / 128) / 2, "fp8": 0.5}[fmt]
    assert per_expert[0] == pytest.approx(dense_bytes * ratio, rel=0.01)
