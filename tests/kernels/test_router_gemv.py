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
