"""moe_sum (weighted expert sum + shared experts + residual add, one launch) against a torch
reference that rounds where models/moe.py and DecoderLayer round; outputs poisoned with NaN."""
import pytest
import torch

from dsquant.runtime.kernels.moe.moe_sum import moe_sum


def reference(pieces, weights, n_shared=0, shared=None, residual=None):
    """The reference model's order: fp32 weighted sum rounded, + shared (rounded), + residual."""
    dtype = pieces.dtype
    top_k = pieces.shape[1] - n_shared
    mlp = (pieces[:, :top_k].float() * weights[:, :top_k, None]).sum(1).to(dtype)
    if n_shared:
        mlp = mlp + pieces[:, top_k:].float().sum(1).to(dtype)
    if shared is not None:
        mlp = mlp + shared
    return mlp if residual is None else residual + mlp


def _inputs(t, p, h, dtype, device):
    pieces = torch.randn(t, p, h, dtype=dtype, device=device)
    weights = torch.rand(t, p, device=device) + 0.05
    return pieces, weights, torch.randn(t, h, dtype=dtype, device=device), torch.randn(t, h, dtype=dtype, device=device)


def _check(pieces, weights, n_shared, shared, residual, exact):
    t, _, h = pieces.shape
    out = torch.full((t, h), float("nan"), dtype=pieces.dtype, device=pieces.device)
    got = moe_sum(pieces, weights, n_shared, shared, residual, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    ref = reference(pieces, weights, n_shared, shared, residual)
    if exact:
        torch.testing.assert_close(got, ref)
    else:  # bf16 on the GPU: fp32 summation order may move a rounding by one ulp
        torch.testing.assert_close(got.float(), ref.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,p,h", [(1, 8, 2048), (3, 2, 64), (5, 7, 200)])
@pytest.mark.parametrize("mode", ["plain", "folded", "shared"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_moe_sum_matches_reference(dtype, t, p, h, mode, with_residual, device):
    pieces, weights, shared, residual = _inputs(t, p, h, dtype, device)
    n_shared = 2 if mode == "folded" else 0
    _check(pieces, weights, n_shared, shared if mode == "shared" else None,
           residual if with_residual else None, exact=True)


def test_moe_sum_strided_pieces(device):
    """pieces as a slice of a wider buffer (row stride larger than P * H)."""
    buf = torch.randn(4, 6, 96, device=device)
    pieces = buf[:, 1:5, :80]
    weights = torch.rand(4, 6, device=device)[:, :4]
    _check(pieces, weights, 1, None, torch.randn(4, 80, device=device), exact=True)


def test_moe_sum_skips_weight_zero_pieces(device):
    """A routed piece of weight 0 is not read (a pair on another rank: fused_moe leaves it unwritten):
    NaN there changes nothing; the folded shared columns are read whatever their weight."""
    pieces, weights, _, residual = _inputs(3, 5, 96, torch.float16, device)
    weights[0, 1] = weights[2, 0] = weights[2, 2] = 0.0
    ref = reference(pieces, weights, 1, None, residual)
    pieces[0, 1] = pieces[2, 0] = pieces[2, 2] = float("nan")
    got = moe_sum(pieces, weights, 1, None, residual)
    torch.testing.assert_close(got, ref)


def test_moe_sum_rejects_mismatched_shapes(device):
    pieces, weights, shared, residual = _inputs(2, 3, 16, torch.float32, device)
    with pytest.raises(ValueError, match="residual has shape"):
        moe_sum(pieces, weights, residual=residual[:1])
    with pytest.raises(ValueError, match="weights must be fp32"):
        moe_sum(pieces, weights[:, :2])
    with pytest.raises(ValueError, match="not both"):
        moe_sum(pieces, weights, 1, shared)


@pytest.mark.gpu
@pytest.mark.parametrize("t,p,h", [(1, 8, 2048), (64, 8, 2048), (3, 9, 7168)])
@pytest.mark.parametrize("mode", ["plain", "folded", "shared"])
def test_moe_sum_bf16(t, p, h, mode, device):
    pieces, weights, shared, residual = _inputs(t, p, h, torch.bfloat16, device)
    _check(pieces, weights, 2 if mode == "folded" else 0, shared if mode == "shared" else None, residual,
           exact=False)
