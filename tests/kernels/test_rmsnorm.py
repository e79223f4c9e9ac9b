"""RMSNorm (+ fused residual add) against transformers' DeepseekV2RMSNorm and a float64 reference."""
import pytest
import torch
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RMSNorm

from dsquant.runtime.kernels.ops.rmsnorm import fused_add_rms_norm, rms_norm


def _reference(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    s = s.double()
    return weight.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)


def _inputs(shape, dtype, device):
    x = torch.randn(*shape, dtype=dtype, device=device)
    residual = torch.randn(*shape, dtype=dtype, device=device) * 2
    weight = (torch.rand(shape[-1], device=device) + 0.5).to(dtype)
    return x, residual, weight


def _tol(dtype):
    return 8e-3 if dtype == torch.bfloat16 else 1e-3


def _check_plain(shape, dtype, device):
    x, _, weight = _inputs(shape, dtype, device)
    out = rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    ref = _reference(x, weight, 1e-6)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < _tol(dtype), f"relative error {err:.2e}"
    hf = DeepseekV2RMSNorm(shape[-1], eps=1e-6).to(device=device, dtype=dtype)
    hf.weight.data.copy_(weight)
    hf_out = hf(x)
    ulp = torch.finfo(dtype).eps * hf_out.float().abs()  # one rounding step at each value
    assert ((out.float() - hf_out.float()).abs() <= 2 * ulp + 1e-6).all(), "more than 2 ulp from HF"


def _check_residual(shape, dtype, device):
    x, residual, weight = _inputs(shape, dtype, device)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.isfinite(out).all() and torch.isfinite(new_residual).all()
    assert torch.equal(new_residual, x + residual), "new residual must be x + residual in x's dtype"
    ref = _reference(x.double() + residual.double(), weight, 1e-5)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < _tol(dtype), f"relative error {err:.2e}"


@pytest.mark.parametrize("shape", [(1, 64), (7, 200), (3, 5, 512)])
def test_rms_norm_matches_reference_and_hf(shape, device):
    _check_plain(shape, torch.float16, device)


@pytest.mark.parametrize("shape", [(1, 64), (9, 300), (2, 3, 1024)])
def test_fused_add_rms_norm(shape, device):
    _check_residual(shape, torch.float16, device)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 2048), (513, 7168), (4096, 5120)])
def test_rms_norm_bf16_full_size(shape, device):
    _check_plain(shape, torch.bfloat16, device)
    _check_residual(shape, torch.bfloat16, device)


def test_rms_norm_names_mismatched_residual(device):
    x, _, weight = _inputs((4, 64), torch.float16, device)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.randn(4, 32, dtype=torch.float16, device=device), weight, 1e-6)
