"""AWQ and GPTQ each beat round-to-nearest where their ideas say they must.

AWQ: inputs with a few large channels (activation outliers) -> scaling protects the weights
of those channels, so the output error falls well below RTN's. GPTQ: correlated inputs ->
error feedback through the inverse Hessian lowers the output error below RTN's.
"""
import torch

from dsquant.calibrate import awq
from dsquant.calibrate.gptq import HessianAccumulator, gptq_quantize
from dsquant.calibrate.quantizers import fake_int, int_grid
from dsquant.calibrate.recipe import AWQOptions, GPTQOptions, SchemeSpec


def output_error(x, w, w_q):
    return ((x @ (w_q - w).t()).norm() / (x @ w.t()).norm()).item()


def test_awq_scales_protect_outlier_channels():
    torch.manual_seed(0)
    k, n = 256, 96
    x = torch.randn(1024, k)
    x[:, torch.randperm(k)[:8]] *= 25  # salient input channels
    w = torch.randn(n, k) * 0.05
    spec = SchemeSpec("awq", 4, 64)
    s = awq.search_scales([awq.Member("m", w, spec, x)], AWQOptions(), torch.float16)
    awq_q = fake_int(w * s, spec, torch.float16) / s
    rtn_q = fake_int(w, spec, torch.float16)
    assert output_error(x, w, awq_q) < 0.8 * output_error(x, w, rtn_q)


def test_awq_clip_search_never_worse_than_no_clip():
    torch.manual_seed(1)
    x, w = torch.randn(512, 128), torch.randn(64, 128)
    w[0, 5] = 8.0  # one outlier weight stretches its group's range
    spec = SchemeSpec("awq", 4, 32)
    ratio = awq.search_clip(x, w, spec, AWQOptions(), torch.float16)
    assert (ratio <= 1).all() and (ratio < 1).any()
    clipped = int_grid(w, spec, torch.float16, clip_ratio=ratio).dequantized
    assert output_error(x, w, clipped) <= output_error(x, w, fake_int(w, spec, torch.float16)) + 1e-6


def test_clip_search_picks_each_groups_best_ratio_by_its_output_error():
    torch.manual_seed(4)
    x, w = torch.randn(300, 96) * (1 + 3 * torch.rand(96)), torch.randn(40, 96)
    spec, opts = SchemeSpec("awq", 4, 32), AWQOptions(clip_grid=10)
    xg = x.reshape(300, 3, 32)

    def group_errors(ratio):  # sum_t (x_g . d_g)^2 computed directly over the tokens: [N, K/G]
        d = (fake_int(w, spec, torch.float16, clip_ratio=ratio) - w).reshape(40, 3, 32)
        return torch.einsum("tgj,ngj->tng", xg, d).pow(2).sum(0)

    ratio = awq.search_clip(x, w, spec, opts, torch.float16)
    chosen = group_errors(ratio)
    for i in range(opts.clip_grid):
        assert (chosen <= group_errors(1 - opts.max_shrink * i / opts.clip_grid) * (1 + 1e-5)).all()
    assert (ratio < 1).any()


def test_gptq_beats_rtn_on_correlated_inputs():
    torch.manual_seed(2)
    k, n = 256, 64
    x = torch.randn(4096, 32) @ torch.randn(32, k) + 0.1 * torch.randn(4096, k)  # low-rank + noise
    w = torch.randn(n, k)
    h = HessianAccumulator(k, "cpu")
    for chunk in x.split(1000):
        h.add(chunk)
    assert torch.allclose(h.h, 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-3)
    for act_order in (False, True):
        spec = SchemeSpec("gptq", 4, 128)
        q = gptq_quantize(w, h, spec, GPTQOptions(act_order=act_order, sym=True), torch.float16)
        rtn = int_grid(w, spec, torch.float16, symmetric=True).dequantized
        assert output_error(x, w, q.dequantized) < 0.7 * output_error(x, w, rtn)
        # the codes, scales and zeros reproduce the dequantized weight exactly
        g = q.g_idx.long()
        rebuilt = (q.q - q.zeros[:, g]).float() * q.scales.float()[:, g]
        assert torch.equal(rebuilt, q.dequantized)
