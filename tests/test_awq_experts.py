"""AWQ's batched search over MoE experts' up -> down groups equals the expert-by-expert search."""
from __future__ import annotations

import torch

from dsquant.calibrate import awq
from dsquant.calibrate.recipe import AWQOptions, SchemeSpec


def _experts(n_experts: int, n: int, k: int, seed: int = 0) -> list[awq.Member]:
    g = torch.Generator().manual_seed(seed)
    spec = SchemeSpec("awq", bits=4, group_size=32)
    out = []
    for e in range(n_experts):
        w = torch.randn(n, k, generator=g) * 10 ** (torch.rand(1, generator=g) * 2 - 1)
        w[:, e % k] *= 20  # an outlier input channel per expert
        t = [0, 1, 17, 40][e % 4]  # token counts differ (one expert got none)
        x = torch.randn(t, k, generator=g) * (1 + 5 * torch.rand(k, generator=g))
        out.append(awq.Member(f"model.layers.1.mlp.experts.{e}.down_proj", w, spec, x))
    return out


def test_batched_expert_search_equals_the_sequential_one():
    opts = AWQOptions(grid=8)
    members = _experts(11, 48, 64)
    want = [awq.search_scales([m], opts, torch.float16) for m in members]
    for chunk in (1, 4, 16):
        got = awq.search_scales_experts(members, opts, torch.float16, chunk=chunk)
        for e, (a, b) in enumerate(zip(want, got)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=0, msg=f"expert {e}, chunk {chunk}")
    assert not torch.equal(want[1], torch.ones(64))  # the search moved off the identity
    assert torch.equal(want[0], torch.ones(64))  # no tokens: identity, as search_scales gives
