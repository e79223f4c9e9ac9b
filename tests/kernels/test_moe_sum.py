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


def _sum_norm_case(t, p, h, dtype, device, mode, seed=0):
    from dsquant.runtime.kernels.moe.moe_sum import MoESumInputs

    torch.manual_seed(seed)
    pieces, weights, shared, residual = _inputs(t, p, h, dtype, device)
    weights[0, 0] = 0.0  # a pair on another rank: its piece is not read
    pieces[0, 0] = float("nan")
    norm_w = torch.exp(torch.randn(h, device=device)).to(dtype)
    return MoESumInputs(pieces, weights, 2 if mode == "folded" else 0, shared if mode == "shared" else None,
                        residual, (1, t, h)), norm_w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,p,h", [(1, 8, 256), (3, 4, 200), (2, 3, 2048)])
@pytest.mark.parametrize("mode", ["plain", "folded", "shared"])
def test_moe_sum_rms_norm_equals_two_launches(dtype, t, p, h, mode, device):
    """The one-launch sum + norm is the two launches' result bit for bit (same per-column sums,
    the same variance reduction), in the layer output's shape."""
    from dsquant.runtime.kernels.moe.moe_sum import moe_sum_rms_norm
    from dsquant.runtime.kernels.ops.rmsnorm import rms_norm

    inputs, norm_w = _sum_norm_case(t, p, h, dtype, device, mode)
    normed, hidden = moe_sum_rms_norm(inputs, norm_w, 1e-6)
    summed = inputs.materialize()
    assert hidden.shape == normed.shape == (1, t, h)
    assert torch.isfinite(hidden).all() and torch.isfinite(normed).all()
    assert torch.equal(hidden, summed)
    assert torch.equal(normed, rms_norm(summed, norm_w, 1e-6))


def test_moe_sum_rms_norm_rejects_bad_weight(device):
    from dsquant.runtime.kernels.moe.moe_sum import moe_sum_rms_norm

    inputs, norm_w = _sum_norm_case(2, 3, 64, torch.float32, device, "plain")
    with pytest.raises(ValueError, match="norm weight has shape"):
        moe_sum_rms_norm(inputs, norm_w[:32], 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 5, 64])
@pytest.mark.parametrize("h", [2048, 7168])
def test_moe_sum_rms_norm_bf16(t, h, device, monkeypatch):
    """bf16 at DeepSeek sizes (a 7168 row is an 8192 block): bit for bit the two launches."""
    from dsquant.runtime.kernels.moe.moe_sum import moe_sum_rms_norm
    from dsquant.runtime.kernels.ops.rmsnorm import rms_norm

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inputs, norm_w = _sum_norm_case(t, 8, h, torch.bfloat16, device, "folded", seed=t)
    normed, hidden = moe_sum_rms_norm(inputs, norm_w, 1e-6)
    summed = inputs.materialize()
    assert torch.equal(hidden, summed) and torch.equal(normed, rms_norm(summed, norm_w, 1e-6))
