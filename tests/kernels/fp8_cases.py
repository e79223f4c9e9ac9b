"""FP8 block weights drawn like trained ones, and the float64 checks, for the FP8 GEMM/GEMV tests."""
import torch

from dsquant.formats.fp8_block import dequantize_fp8_block, quantize_fp8_block
from tests.realistic_weights import max_block_rel_err, realistic_weight


def fp8_weights(n: int, k: int, device, seed: int):
    """(weight e4m3 [N, K], weight_scale_inv fp32 [ceil(N/128), ceil(K/128)], dense float64 [N, K]):
    block scales spread over three orders of magnitude, outlier input channels, zero rows and a
    zero block (tests/realistic_weights.py)."""
    wq, ws = quantize_fp8_block(realistic_weight(n, k, seed=seed))
    return wq.to(device), ws.to(device), dequantize_fp8_block(wq, ws, torch.float64)


def dequant_act(xq: torch.Tensor, xs: torch.Tensor, k: int) -> torch.Tensor:
    """The float64 values a W8A8 GEMM multiplies: x_fp8 [M, K] * x_scale [M, ceil(K/128)]."""
    return xq.cpu().to(torch.float64) * xs.cpu().to(torch.float64).repeat_interleave(128, 1)[:, :k]


def check_fp8_product(y: torch.Tensor, a_dense: torch.Tensor, w_dense: torch.Tensor, tol: float):
    """y [M, N] against a_dense @ w_dense^T (float64 on the CPU, or float32 on the GPU for large
    shapes: far below the tolerances), over the whole output and over every block
    of 128 output channels (a wrong scale in a small block must not hide under the large ones)."""
    ref = a_dense @ w_dense.to(a_dense.device).t()  # [M, N], a_dense's dtype and device
    assert torch.isfinite(y).all(), "output has NaN/Inf: some element was not written"
    err = ((y.to(ref.device).double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"
    worst = max_block_rel_err(y, ref)
    assert worst < 4 * tol, f"worst 128-channel block relative error {worst:.3g} >= {4 * tol}"


def poisoned(m: int, n: int, dtype, device) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)
