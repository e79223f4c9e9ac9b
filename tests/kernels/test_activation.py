"""SiLU-and-mul kernel against a float64 torch reference on fresh random inputs."""
import pytest
import torch

from dsquant.runtime.kernels.ops.activation import silu_and_mul, silu_mul


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


def _check_pair(shape, dtype, device):
    """silu_mul on separate gate/up (strided row views of one GEMM output) equals torch's
    F.silu(gate) * up in the same dtype: silu rounded to the dtype, then the product rounded."""
    inter = shape[-1]
    both = torch.randn(*shape[:-1], 2 * inter + 8, dtype=dtype, device=device) * 3
    gate, up = both[..., :inter], both[..., inter + 8:]
    out = torch.full(shape, float("nan"), dtype=dtype, device=device)
    got = silu_mul(gate, up, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    ref = torch.nn.functional.silu(gate) * up
    tol = {torch.float32: (2e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}[dtype]
    torch.testing.assert_close(out, ref, rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 8), (1, 5, 100), (3, 1408)])
def test_silu_mul_matches_torch(shape, dtype, device):
    _check_pair(shape, dtype, device)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 2816), (1, 64, 10944), (4096, 2816)])
def test_silu_mul_bf16_full_size(shape, device):
    _check_pair(shape, torch.bfloat16, device)


def test_silu_mul_rejects_mismatched_pair(device):
    with pytest.raises(ValueError, match="gate and up"):
        silu_mul(torch.randn(2, 8, device=device), torch.randn(2, 9, device=device))
