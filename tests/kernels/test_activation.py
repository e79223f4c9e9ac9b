"""SiLU-and-mul kernel against a float64 torch reference on fresh random inputs."""
import pytest
import torch

from dsquant.runtime.kernels.activation import silu_and_mul


def _reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _check(t, inter, dtype, device):
    x = torch.randn(t, 2 * inter, dtype=dtype, device=device) * 3
    out = torch.full((t, inter), float("nan"), dtype=dtype, device=device)
    silu_and_mul(x, out=out)
    assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
    ref = _reference(x)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < (4e-3 if dtype == torch.bfloat16 else 1e-3), f"relative error {err:.2e}"


@pytest.mark.parametrize("t,inter", [(1, 8), (5, 100), (33, 1408)])
def test_silu_and_mul_matches_reference(t, inter, device):
    _check(t, inter, torch.float16, device)


@pytest.mark.gpu
@pytest.mark.parametrize("t,inter", [(1, 1408), (77, 1408), (4096, 18432)])
def test_silu_and_mul_bf16_full_size(t, inter, device):
    _check(t, inter, torch.bfloat16, device)


def test_silu_and_mul_rejects_odd_width(device):
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_and_mul(torch.randn(2, 7, device=device))
